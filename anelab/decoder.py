"""The whole-model decoder math in NumPy (fp32): embeddings, pre-norm layers around an injected attention, MLP, LM head.

A decoder layer of the dense families anelab supports (transformers ``LlamaDecoderLayer`` and its
copies in mistral / qwen2 / qwen3 / qwen3_moe) is

    h   = x + attention(rms_norm(x, input_norm))
    out = h + mlp(rms_norm(h, post_attention_norm))

with ``mlp`` either SwiGLU, ``down(silu(gate(x)) * up(x))``, or Qwen3-MoE's routed experts:
``softmax`` over the router logits in fp32, the ``top_k`` highest probabilities, renormalised to sum
1 when ``norm_topk_prob``, each selected expert's SwiGLU output weighted by its probability and
summed (``Qwen3MoeTopKRouter`` / ``Qwen3MoeExperts`` in ``modeling_qwen3_moe.py``). The model ends
with a final RMSNorm and the LM head (the embedding matrix itself when the embeddings are tied).

The attention is not computed here: the caller passes its output (``anelab.reference`` or a saved
sidecar serves it), so the same layer math runs under every arm. Shapes: T rows, D = hidden_size,
I = intermediate size, E = experts, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from anelab.errors import AnelabInputError
from anelab.reference import rms_norm

DTYPE = np.float32
LINEAR_BLOCK_BYTES = 32 * 2**20  # float32 rows of a file-backed weight (the LM head) converted at a time


@dataclass
class MlpWeights:
    """One SwiGLU MLP: gate_proj [I, D], up_proj [I, D], down_proj [D, I] (float32)."""

    gate_proj: np.ndarray
    up_proj: np.ndarray
    down_proj: np.ndarray


@dataclass
class MoeWeights:
    """Qwen3-MoE routed experts: router [E, D] (``mlp.gate.weight``), one ``MlpWeights`` per expert."""

    router: np.ndarray
    experts: list[MlpWeights]
    top_k: int
    norm_topk_prob: bool


@dataclass
class DecoderLayerWeights:
    """The non-attention parameters of one decoder layer: the two RMSNorm weights [D] and the MLP."""

    layer: int
    input_norm: np.ndarray
    post_attention_norm: np.ndarray
    mlp: MlpWeights | MoeWeights


@dataclass
class HeadWeights:
    """embed_tokens [V, D], final_norm [D], lm_head [V, D] (the same array as embed_tokens when tied).

    embed_tokens and lm_head are float32 arrays or tensors left in their file (``MappedTensor``: rows
    read on demand — ``embed`` gathers a prompt's rows, ``lm_logits`` reads vocabulary blocks).
    """

    embed_tokens: np.ndarray
    final_norm: np.ndarray
    lm_head: np.ndarray
    tied: bool

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.shape[0])


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), with sigmoid as 0.5 * (1 + tanh(x / 2)) (no overflow for large |x|)."""
    return x * (0.5 * (1.0 + np.tanh(0.5 * x)))


def embed(tokens: np.ndarray, head: HeadWeights) -> np.ndarray:
    """Token ids int [T] -> embeddings float32 [T, D]; refuses an id outside 0 .. V-1."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise AnelabInputError(f"token ids must be a 1-D integer array, got {tokens.dtype} {list(tokens.shape)}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= head.vocab_size):
        raise AnelabInputError(f"token ids must lie in 0..{head.vocab_size - 1} (the vocabulary), got {tokens.max()}")
    return head.embed_tokens[tokens].astype(DTYPE)


def swiglu(x: np.ndarray, mlp: MlpWeights) -> np.ndarray:
    """x [T, D] -> down(silu(gate(x)) * up(x)) [T, D]."""
    return (silu(x @ mlp.gate_proj.T) * (x @ mlp.up_proj.T)) @ mlp.down_proj.T


def route(x: np.ndarray, moe: MoeWeights) -> tuple[np.ndarray, np.ndarray]:
    """Router: x [T, D] -> (experts int [T, k] by descending probability, weights float32 [T, k])."""
    logits = (x @ moe.router.T).astype(np.float64)  # [T, E]
    logits -= logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")[:, : moe.top_k]
    top = np.take_along_axis(probs, order, axis=-1)
    if moe.norm_topk_prob:
        top = top / top.sum(axis=-1, keepdims=True)
    return order, top.astype(DTYPE)


def moe_mlp(x: np.ndarray, moe: MoeWeights) -> np.ndarray:
    """x [T, D] -> sum over each row's top-k experts of weight * SwiGLU_expert(row) [T, D]."""
    experts, weights = route(x, moe)
    out = np.zeros_like(x)
    for e in np.unique(experts):
        rows, slot = np.nonzero(experts == e)
        out[rows] += swiglu(x[rows], moe.experts[int(e)]) * weights[rows, slot, None]
    return out


def mlp_forward(x: np.ndarray, mlp: MlpWeights | MoeWeights) -> np.ndarray:
    """x [T, D] -> the layer's MLP output [T, D] (SwiGLU or routed experts)."""
    return moe_mlp(x, mlp) if isinstance(mlp, MoeWeights) else swiglu(x, mlp)


def attention_input(hidden: np.ndarray, layer: DecoderLayerWeights, eps: float) -> np.ndarray:
    """The attention block's input: rms_norm(hidden [T, D], input_norm) [T, D]."""
    return rms_norm(hidden.astype(DTYPE), layer.input_norm, eps)


def finish_layer(hidden: np.ndarray, attn_out: np.ndarray, layer: DecoderLayerWeights, eps: float) -> np.ndarray:
    """The rest of the layer after the attention: residual add, post-attention norm, MLP, residual add.

    hidden [T, D] the layer's input, attn_out [T, D] the attention branch (o_proj output) -> [T, D].
    """
    h = hidden.astype(DTYPE) + np.asarray(attn_out, dtype=DTYPE)
    return h + mlp_forward(rms_norm(h, layer.post_attention_norm, eps), layer.mlp)


def linear(x: np.ndarray, weight, block_bytes: int = LINEAR_BLOCK_BYTES) -> np.ndarray:
    """x [T, K] @ weight [N, K].T -> float32 [T, N].

    ``weight``: a float32 array, or a tensor left in its file (``anelab.hf.safetensors_io.MappedTensor``:
    ``weight[r0:r1]`` returns those rows as float32), read in row blocks of at most ``block_bytes`` so it
    is never held whole in float32.
    """
    if isinstance(weight, np.ndarray):
        return x @ weight.T
    n, k = weight.shape
    rows = max(1, block_bytes // (4 * k))
    out = np.empty((x.shape[0], n), DTYPE)
    for r0 in range(0, n, rows):
        out[:, r0 : r0 + rows] = x @ np.asarray(weight[r0 : r0 + rows], DTYPE).T
    return out


def lm_logits(hidden: np.ndarray, head: HeadWeights, eps: float) -> np.ndarray:
    """Final norm and LM head: hidden [T, D] -> logits float32 [T, V] (the LM head read in vocabulary blocks)."""
    return linear(rms_norm(hidden.astype(DTYPE), head.final_norm, eps), head.lm_head)


# ---- deterministic random weights (tests, the embedded dense checkpoint) ---------------------------------
def _normal(rng, shape, scale) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(DTYPE)


def random_mlp(rng, hidden: int, intermediate: int) -> MlpWeights:
    """SwiGLU weights ~ N(0, 1/fan_in)."""
    return MlpWeights(
        gate_proj=_normal(rng, (intermediate, hidden), hidden**-0.5),
        up_proj=_normal(rng, (intermediate, hidden), hidden**-0.5),
        down_proj=_normal(rng, (hidden, intermediate), intermediate**-0.5),
    )


def random_layer_weights(
    layer: int,
    hidden: int,
    intermediate: int,
    seed: int,
    *,
    experts: int = 0,
    top_k: int = 0,
    norm_topk_prob: bool = False,
) -> DecoderLayerWeights:
    """One layer's norms (1 + N(0, 0.1^2)) and MLP; ``experts`` > 0 gives routed experts of width ``intermediate``."""
    rng = np.random.default_rng([int(seed), int(layer), 0xDEC])
    norms = [np.float32(1.0) + _normal(rng, (hidden,), 0.1) for _ in range(2)]
    if experts:
        mlp = MoeWeights(
            router=_normal(rng, (experts, hidden), hidden**-0.5),
            experts=[random_mlp(rng, hidden, intermediate) for _ in range(experts)],
            top_k=int(top_k),
            norm_topk_prob=bool(norm_topk_prob),
        )
    else:
        mlp = random_mlp(rng, hidden, intermediate)
    return DecoderLayerWeights(layer, norms[0], norms[1], mlp)


def random_head_weights(vocab: int, hidden: int, seed: int, *, tied: bool) -> HeadWeights:
    """Embeddings ~ N(0, 1), final norm 1 + N(0, 0.1^2), and an LM head ~ N(0, 1/D) unless tied."""
    rng = np.random.default_rng([int(seed), 0xEAD])
    embed_tokens = _normal(rng, (vocab, hidden), 1.0)
    final_norm = np.float32(1.0) + _normal(rng, (hidden,), 0.1)
    lm_head = embed_tokens if tied else _normal(rng, (vocab, hidden), hidden**-0.5)
    return HeadWeights(embed_tokens, final_norm, lm_head, tied)
