"""The whole-model decoder math in NumPy (fp32): embeddings, decoder layers around an injected attention, MLP, LM head.

One decoder layer of every family anelab supports is

    a   = attention(norm(x, input_norm))            # input_norm None: the raw residual rows (OLMo 2)
    h   = x + residual_multiplier * norm(a, attention_out_norm)
    m   = mlp(norm(h, mlp_norm))                    # mlp_norm None: the raw residual rows (OLMo 2)
    out = h + residual_multiplier * norm(m, mlp_out_norm)

where a norm slot left None is skipped. The families differ only in which slots hold a norm
(Llama: input and MLP norms; Gemma 2/3: all four; OLMo 2: the two output norms; GLM-4: all four),
the norm kind (RMSNorm ``x / sqrt(mean(x^2) + eps) * w`` or LayerNorm with bias), the MLP kind and
activation, and four scalars: ``residual_multiplier`` (Granite), the embedding multiplier
(Gemma: sqrt(hidden); Granite), the logit divisor (Granite's ``logits_scaling``) and the final
logit soft-cap ``cap * tanh(logits / cap)`` (Gemma 2). ``anelab.checkpoints.whole_model.DECODER_FAMILIES`` declares
them per ``model_type`` (transformers file:line in docs/conventions.md §9); this module never
looks at a family name. Zero-centred norm weights (Gemma's ``x * (1 + w)``) arrive as the
effective multiplier ``1 + w``: the loader folds them, as it does for q/k norms.

MLP kinds: gated ``down(act(gate(x)) * up(x))`` (Llama; Phi-3 / GLM's fused ``gate_up_proj`` is
split at load, gate first), plain ``c_proj(act(c_fc(x)))`` with biases (Starcoder2), or Qwen3-MoE's
routed experts: ``softmax`` over the router logits in fp32, the ``top_k`` highest probabilities,
renormalised to sum 1 when ``norm_topk_prob``, each selected expert's gated output weighted by its
probability and summed (``Qwen3MoeTopKRouter`` / ``Qwen3MoeExperts`` in ``modeling_qwen3_moe.py``).
The model ends with a final norm and the LM head (the embedding matrix itself when tied).

The attention is not computed here: the caller passes its output (``anelab.core.reference`` or a saved
sidecar serves it), so the same layer math runs under every arm. Shapes: T rows, D = hidden_size,
I = intermediate size, E = experts, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.matmul import matmul
from anelab.core.reference import rms_norm

DTYPE = np.float32
NORM_KINDS = ("rms", "layer")
LINEAR_BLOCK_BYTES = 32 * 2**20  # rows of a weight (the LM head) converted at a time, in their float64 bytes


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), with sigmoid as 0.5 * (1 + tanh(x / 2)) (no overflow for large |x|); one new array,
    computed in place (the same operations in the same order as the plain expression)."""
    out = np.multiply(x, 0.5)
    np.tanh(out, out=out)
    out += 1.0
    out *= 0.5
    out *= x
    return out


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi).astype(x.dtype) * (x + 0.044715 * x * x * x)))


# transformers' ACT2FN names modelled here (activations.py); any other is refused by the loader.
ACTIVATIONS = {
    "silu": silu,
    "swish": silu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_python_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
}


@dataclass
class Norm:
    """One norm over the last axis: weight [D] (the effective multiplier), bias [D] for a LayerNorm.

    kind ``rms``: ``x / sqrt(mean(x^2) + eps) * weight``; ``layer``: ``(x - mean) / sqrt(var + eps) * weight + bias``.
    """

    weight: np.ndarray
    bias: np.ndarray | None = None
    kind: str = "rms"

    def __post_init__(self):
        if self.kind not in NORM_KINDS:
            raise AnelabInputError(f"norm kind {self.kind!r} is not one of {', '.join(NORM_KINDS)}")
        if (self.bias is not None) != (self.kind == "layer"):
            raise AnelabInputError("a LayerNorm needs a bias and an RMSNorm has none")


def apply_norm(x: np.ndarray, norm: Norm | None, eps: float) -> np.ndarray:
    """x [T, D] -> normed [T, D] float32; ``norm`` None leaves x as it is."""
    if norm is None:
        return x
    if norm.kind == "rms":
        return rms_norm(x, norm.weight, eps)
    centred = x - x.mean(axis=-1, keepdims=True)
    var = np.einsum("...i,...i->...", centred, centred) / x.shape[-1]
    return centred / np.sqrt(var + eps)[..., None] * norm.weight + norm.bias


@dataclass
class MlpWeights:
    """One gated MLP: gate_proj [I, D], up_proj [I, D], down_proj [D, I] (float32); ``activation`` on the gate;
    optional biases gate_bias [I], up_bias [I], down_bias [D] (``mlp_bias``)."""

    gate_proj: np.ndarray
    up_proj: np.ndarray
    down_proj: np.ndarray
    activation: str = "silu"
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None


@dataclass
class PlainMlpWeights:
    """One ungated MLP (Starcoder2): c_fc [I, D] + fc_bias [I], c_proj [D, I] + proj_bias [D] (biases optional)."""

    fc: np.ndarray
    fc_bias: np.ndarray | None
    proj: np.ndarray
    proj_bias: np.ndarray | None
    activation: str = "gelu_pytorch_tanh"


@dataclass
class MoeWeights:
    """Qwen3-MoE routed experts: router [E, D] (``mlp.gate.weight``), one ``MlpWeights`` per expert."""

    router: np.ndarray
    experts: list[MlpWeights]
    top_k: int
    norm_topk_prob: bool


@dataclass
class DecoderLayerWeights:
    """The non-attention parameters of one decoder layer: its norm slots (None: no norm there), the
    MLP and the factor on both branches at the residual adds (module docstring)."""

    layer: int
    input_norm: Norm | None
    mlp_norm: Norm | None
    mlp: MlpWeights | PlainMlpWeights | MoeWeights
    attention_out_norm: Norm | None = None
    mlp_out_norm: Norm | None = None
    residual_multiplier: float = 1.0


@dataclass
class HeadWeights:
    """embed_tokens [V, D], final_norm, lm_head [V, D] (the same array as embed_tokens when tied), and the
    scalars around them: embeddings times ``embedding_multiplier``; logits divided by ``logit_divisor``,
    then soft-capped ``cap * tanh(logits / cap)`` when ``logit_softcap`` is set.

    embed_tokens and lm_head are float32 arrays or tensors left in their file (``MappedTensor``: rows
    read on demand — ``embed`` gathers a prompt's rows, ``lm_logits`` reads vocabulary blocks).
    """

    embed_tokens: np.ndarray
    final_norm: Norm
    lm_head: np.ndarray
    tied: bool
    embedding_multiplier: float = 1.0
    logit_divisor: float = 1.0
    logit_softcap: float | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.shape[0])


def embed(tokens: np.ndarray, head: HeadWeights) -> np.ndarray:
    """Token ids int [T] -> embeddings float32 [T, D] (times the embedding multiplier); refuses an id outside 0 .. V-1."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise AnelabInputError(f"token ids must be a 1-D integer array, got {tokens.dtype} {list(tokens.shape)}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= head.vocab_size):
        raise AnelabInputError(f"token ids must lie in 0..{head.vocab_size - 1} (the vocabulary), got {tokens.max()}")
    rows = head.embed_tokens[tokens].astype(DTYPE)
    if head.embedding_multiplier != 1.0:
        rows *= DTYPE(head.embedding_multiplier)
    return rows


def _activation(name: str):
    if name not in ACTIVATIONS:
        raise AnelabInputError(
            f"activation {name!r} is not modelled; the whole-model forward runs {', '.join(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


def _linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """x [T, in] @ weight [out, in].T (+ bias [out]) -> [T, out]."""
    y = matmul(x, weight.T)
    if bias is not None:
        y += bias
    return y


def swiglu(x: np.ndarray, mlp: MlpWeights) -> np.ndarray:
    """x [T, D] -> down(act(gate(x)) * up(x)) [T, D] (SiLU: SwiGLU; GELU-tanh: GeGLU), biases where present."""
    gated = _activation(mlp.activation)(_linear(x, mlp.gate_proj, mlp.gate_bias)) * _linear(x, mlp.up_proj, mlp.up_bias)
    return _linear(gated, mlp.down_proj, mlp.down_bias)


def plain_mlp(x: np.ndarray, mlp: PlainMlpWeights) -> np.ndarray:
    """x [T, D] -> c_proj(act(c_fc(x))) [T, D], biases added where present."""
    return _linear(_activation(mlp.activation)(_linear(x, mlp.fc, mlp.fc_bias)), mlp.proj, mlp.proj_bias)


def route(x: np.ndarray, moe: MoeWeights) -> tuple[np.ndarray, np.ndarray]:
    """Router: x [T, D] -> (experts int [T, k] by descending probability, weights float32 [T, k])."""
    logits = matmul(x, moe.router.T).astype(np.float64)  # [T, E]
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


def mlp_forward(x: np.ndarray, mlp: MlpWeights | PlainMlpWeights | MoeWeights) -> np.ndarray:
    """x [T, D] -> the layer's MLP output [T, D] (gated, plain or routed experts)."""
    if isinstance(mlp, MoeWeights):
        return moe_mlp(x, mlp)
    return plain_mlp(x, mlp) if isinstance(mlp, PlainMlpWeights) else swiglu(x, mlp)


def attention_input(hidden: np.ndarray, layer: DecoderLayerWeights, eps: float) -> np.ndarray:
    """The attention block's input: hidden [T, D] through the layer's input norm (none: the rows as they are) [T, D]."""
    return apply_norm(hidden.astype(DTYPE), layer.input_norm, eps)


def _residual_add(x: np.ndarray, branch: np.ndarray, norm: Norm | None, layer: DecoderLayerWeights, eps) -> np.ndarray:
    branch = apply_norm(np.asarray(branch, dtype=DTYPE), norm, eps)
    if layer.residual_multiplier != 1.0:
        branch = branch * DTYPE(layer.residual_multiplier)
    return x + branch


def finish_layer(
    hidden: np.ndarray, attn_out: np.ndarray, layer: DecoderLayerWeights, eps: float, mlp=None
) -> np.ndarray:
    """The rest of the layer after the attention: its output norm, residual add, MLP (between its norms), residual add.

    hidden [T, D] the layer's input, attn_out [T, D] the attention branch (o_proj output) -> [T, D]. ``mlp``: who
    computes the MLP, (normed rows [T, D]) -> [T, D] (a saved sidecar); None: ``mlp_forward`` with the layer's weights.
    """
    h = _residual_add(hidden.astype(DTYPE), attn_out, layer.attention_out_norm, layer, eps)
    normed = apply_norm(h, layer.mlp_norm, eps)
    branch = mlp_forward(normed, layer.mlp) if mlp is None else mlp(normed)
    return _residual_add(h, branch, layer.mlp_out_norm, layer, eps)


def linear(x: np.ndarray, weight, block_bytes: int = LINEAR_BLOCK_BYTES) -> np.ndarray:
    """x [T, K] @ weight [N, K].T -> float32 [T, N].

    ``weight``: a float32 array, or a tensor left in its file (``anelab.checkpoints.safetensors_io.MappedTensor``:
    ``weight[r0:r1]`` returns those rows as float32), read in row blocks of at most ``block_bytes`` (in float64,
    as ``core.matmul`` widens them) so it is never held whole in float32 or float64.
    """
    return linear_each([x], weight, block_bytes)[0]


def linear_each(xs: list[np.ndarray], weight, block_bytes: int = LINEAR_BLOCK_BYTES) -> list[np.ndarray]:
    """``[linear(x, weight) for x in xs]`` reading ``weight`` once, in row blocks: each block is converted once
    and every x [T_i, K] multiplied by it on its own (the same products as separate calls). The blocks bound the
    float64 copy ``core.matmul`` makes of the weight, in memory too (``block_bytes`` of it at a time)."""
    n, k = weight.shape
    rows = max(1, block_bytes // (np.dtype(np.float64).itemsize * k))
    outs = [np.empty((x.shape[0], n), DTYPE) for x in xs]
    for r0 in range(0, n, rows):
        block = np.asarray(weight[r0 : r0 + rows], DTYPE)
        for x, out in zip(xs, outs, strict=True):
            matmul(x, block.T, out=out[:, r0 : r0 + rows])
    return outs


def lm_logits(hidden: np.ndarray, head: HeadWeights, eps: float) -> np.ndarray:
    """Final norm, LM head (read in vocabulary blocks), logit divisor and soft-cap: hidden [T, D] -> logits float32 [T, V]."""
    return lm_logits_each([hidden], head, eps)[0]


def lm_logits_each(hiddens: list[np.ndarray], head: HeadWeights, eps: float) -> list[np.ndarray]:
    """``lm_logits`` of several hidden states [T_i, D] with the LM head's blocks read once for all of them."""
    normed = [apply_norm(h.astype(DTYPE), head.final_norm, eps) for h in hiddens]
    outs = linear_each(normed, head.lm_head)
    for logits in outs:
        if head.logit_divisor != 1.0:
            logits /= DTYPE(head.logit_divisor)
        if head.logit_softcap is not None:
            cap = DTYPE(head.logit_softcap)
            logits[...] = cap * np.tanh(logits / cap)
    return outs


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
    """One Llama-style layer's norms (1 + N(0, 0.1^2)) and MLP; ``experts`` > 0 gives routed experts of width ``intermediate``."""
    rng = np.random.default_rng([int(seed), int(layer), 0xDEC])
    norms = [Norm(np.float32(1.0) + _normal(rng, (hidden,), 0.1)) for _ in range(2)]
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
    final_norm = Norm(np.float32(1.0) + _normal(rng, (hidden,), 0.1))
    lm_head = embed_tokens if tied else _normal(rng, (vocab, hidden), hidden**-0.5)
    return HeadWeights(embed_tokens, final_norm, lm_head, tied)
