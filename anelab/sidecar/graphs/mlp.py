"""The MLP block's sidecar graph: one chunk-shaped function, ``mlp_out = down(act(gate(x)) * up(x))``, no history.

Inputs / outputs (C = chunk rows, D = hidden_size, I = intermediate size; fp16):

    hidden   [C, D]   the layer's MLP input: the post-attention residual rows through the MLP's norm
    mlp_out  [C, D]   the MLP's output, before any output norm and the residual add (the caller's)

Rows are independent: a partial chunk is padded with any rows and its real rows read back. The activation is the
family's (``core.decoder.ACTIVATIONS``: SiLU for Llama / Qwen, GELU with the tanh approximation for Gemma), biases
where the checkpoint has them (``mlp_bias``). Each projection is a MIL ``linear`` named after its tensor, so
``sidecar.quantize`` compresses it and reads it back by that name.
"""

from __future__ import annotations

from anelab.core.decoder import MlpWeights
from anelab.core.errors import AnelabInputError
from anelab.sidecar.coremltools_import import coremltools_modules
from anelab.sidecar.graphs.common import linear

MLP_INPUT, MLP_OUTPUT = "hidden", "mlp_out"
# the MLP's linear ops (output names) -> the MlpWeights field each holds (sidecar.quantize reads them back)
MLP_PROJECTIONS = {"gate_proj": "gate_proj", "up_proj": "up_proj", MLP_OUTPUT: "down_proj"}
# transformers' activation names (core.decoder.ACTIVATIONS) -> the MIL op computing it
ACTIVATION_OPS = {
    "silu": lambda mb, x: mb.silu(x=x, name="activation"),
    "swish": lambda mb, x: mb.silu(x=x, name="activation"),
    "gelu_pytorch_tanh": lambda mb, x: mb.gelu(x=x, mode="TANH_APPROXIMATION", name="activation"),
    "gelu_python_tanh": lambda mb, x: mb.gelu(x=x, mode="TANH_APPROXIMATION", name="activation"),
    "gelu_new": lambda mb, x: mb.gelu(x=x, mode="TANH_APPROXIMATION", name="activation"),
}


def build_mlp_program(weights: MlpWeights, hidden_size: int, chunk: int):
    """The MLP sidecar function for ``chunk`` rows: a MIL Program (opset iOS18), input ``hidden`` [C, D] ->
    output ``mlp_out`` [C, D] (module docstring). An activation without a MIL op here is refused in one line."""
    if weights.activation not in ACTIVATION_OPS:
        raise AnelabInputError(
            f"activation {weights.activation!r} has no MLP sidecar graph; supported: {', '.join(ACTIVATION_OPS)}"
        )
    ct, mb, types = coremltools_modules()
    spec = [mb.TensorSpec(shape=(chunk, hidden_size), dtype=types.fp16)]

    @mb.program(input_specs=spec, opset_version=ct.target.iOS18)
    def prog(hidden):
        gate = linear(mb, hidden, weights.gate_proj, weights.gate_bias, "gate_proj")
        up = linear(mb, hidden, weights.up_proj, weights.up_bias, "up_proj")
        gated = mb.mul(x=ACTIVATION_OPS[weights.activation](mb, gate), y=up, name="gated")
        return linear(mb, gated, weights.down_proj, weights.down_bias, MLP_OUTPUT)

    return prog
