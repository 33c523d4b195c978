"""A Gated DeltaNet layer's input projections as a sidecar graph: one chunk-shaped function, four ``linear`` ops.

Inputs / outputs (C = chunk rows, D = hidden_size; Hk / Hv key / value heads of dk / dv dims; fp16):

    hidden  [C, D]                     the layer's post-input-norm rows
    qkv     [C, 2 Hk dk + Hv dv]       q | k | v, the causal conv1d's input (kept on the GPU with the recurrence)
    z       [C, Hv dv]                 the output gate of the layer's RMSNormGated
    b       [C, Hv]                    beta's logits (beta = sigmoid(b), applied by the caller)
    a       [C, Hv]                    the decay's input (g = exp(-exp(A_log) softplus(a + dt_bias)), the caller's)

No history, rows independent. Weights in ``core.gated_deltanet``'s layout (Qwen3-Next's fused rows reordered at
read, ``checkpoints.blocks``), so the outputs are the same for Qwen 3.5 and Qwen3-Next.
"""

from __future__ import annotations

from anelab.core.gated_deltanet import GDN_OUTPUTS, GdnProjectionWeights
from anelab.sidecar.coremltools_import import coremltools_modules
from anelab.sidecar.graphs.common import linear

# the linear ops (output names) -> the GdnProjectionWeights field each holds (sidecar.quantize reads them back)
GDN_PROJECTIONS = {name: name for name in GDN_OUTPUTS}


def build_gdn_projection_program(weights: GdnProjectionWeights, hidden_size: int, chunk: int):
    """The projections for ``chunk`` rows: a MIL Program (opset iOS18), ``hidden`` [C, D] -> qkv, z, b, a."""
    ct, mb, types = coremltools_modules()
    spec = [mb.TensorSpec(shape=(chunk, hidden_size), dtype=types.fp16)]

    @mb.program(input_specs=spec, opset_version=ct.target.iOS18)
    def prog(hidden):
        return tuple(linear(mb, hidden, getattr(weights, name), None, name) for name in GDN_OUTPUTS)

    return prog
