"""The GPU arm of your model from your model: its weight bytes per token and its own attention geometry.

What the seed's GPU path (TinyTitan on an Apple M3, 24 GB) costs, from the recorded A/B rows:

- non-attention: the family fits (``CostFit.non_attention_seconds``) divided by ``tokens x weight
  bytes per token`` come out at about one M3 memory bandwidth for every dense family (4-bit and
  8-bit alike): that path reads its active weights once per token. ``runtime_bandwidth`` is that
  rate, fitted (geometric mean) over the dense families; a checkpoint's non-attention is its own
  weight bytes per token (``weight_bytes_per_token``: active parameters for MoE, the storage's
  bytes per weight) x tokens / that rate.
- attention: the fitted rate per score entry at head_dim 256 (every recorded family's) is a rate
  per matmul FLOP (``4 x head_dim`` per entry: QK^T and PV); a checkpoint's score entries are its
  own heads, layers and chunks (``planner.plan``), scaled by its head_dim / 256.

Carrying another runtime's rates to another model is the runtime question: a batched GPU runtime
can be an order of magnitude faster than this path, so the estimate's envelope is x/÷
``RUNTIME_BAND`` (``planner.verdict``), not the fit's few percent. The weights of the recorded
families are assumed from their names (``FAMILY_WEIGHTS``), not recorded.
"""

from __future__ import annotations

import math

from anelab.core.errors import AnelabInputError
from anelab.planner.catalogue import FAMILIES, REFERENCE_TOKENS

RUNTIME = "TinyTitan's GPU path on an Apple M3 (seed 000)"
RUNTIME_BAND = 10.0  # x/÷: another runtime on the same Mac can be ten times faster (or slower)
RECORDED_HEAD_DIM = 256  # every recorded family's head_dim (the fitted rates' geometry)

# bytes per stored weight: GGUF block formats carry fp16 scales (and mins) per 32 weights; MLX's 4/8-bit
# carry an fp16 scale and bias per 64
BYTES_PER_WEIGHT = {
    "F32": 4.0, "BF16": 2.0, "F16": 2.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q5_0": 22 / 32,
    "Q5_1": 24 / 32, "Q6_K": 210 / 256, "Q4_K": 144 / 256, "Q5_K": 176 / 256, "Q3_K": 110 / 256, "Q2_K": 84 / 256,
    "mlx-4bit": 4.5 / 8, "mlx-8bit": 8.5 / 8,
}  # fmt: skip

# (active parameters, storage) of the recorded families: assumed from their names (total for dense,
# the "A" figure for MoE), MLX quantization at the family's bits
FAMILY_WEIGHTS = {
    name: (
        {"2b": 2e9, "4b": 4e9, "9b": 9e9, "35b-a3b": 3e9, "125b-a6b": 6e9}[f.model.split("-", 1)[1]],
        f"mlx-{f.name.rsplit('-', 1)[1]}",
    )
    for name, f in FAMILIES.items()
}


def bytes_per_weight(storage: str) -> tuple[float, str]:
    """(bytes, how known) of one weight stored as ``storage`` (``Checkpoint.tensor_dtype()``)."""
    if storage in BYTES_PER_WEIGHT:
        return BYTES_PER_WEIGHT[storage], f"{storage}: {BYTES_PER_WEIGHT[storage]:.4g} B/weight"
    return 2.0, f"{storage}: not in the table, assumed 2 B/weight (fp16)"


def active_parameters(text: dict) -> int:
    """Linear weights one token multiplies through (config.json ``text``): every layer's q/k/v/o and MLP
    (for MoE: the routed experts per token plus any shared expert); embeddings and lm_head excluded
    (prefill needs the last token's logits only)."""
    try:
        hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        raise AnelabInputError("config.json lacks hidden_size / num_hidden_layers / num_attention_heads") from None
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv = int(text.get("num_key_value_heads") or heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    experts = text.get("num_experts_per_tok") or 0
    moe_width = text.get("moe_intermediate_size")
    if experts and moe_width:
        mlp = 3 * hidden * int(moe_width) * int(experts) + 3 * hidden * int(
            text.get("shared_expert_intermediate_size") or 0
        )
    else:
        mlp = 3 * hidden * int(text.get("intermediate_size") or 4 * hidden)
    return layers * (attention + mlp)


def runtime_bandwidth(non_attention_seconds: dict) -> float:
    """Bytes per second of weights the recorded GPU path streams per token: the geometric mean over the dense
    families of ``tokens x weight bytes / fitted non-attention`` (families fitted at 0 s are left out)."""
    rates = []
    for name, seconds in non_attention_seconds.items():
        if FAMILIES[name].sparse or seconds <= 0:
            continue
        params, storage = FAMILY_WEIGHTS[name]
        rates.append(REFERENCE_TOKENS * params * BYTES_PER_WEIGHT[storage] / seconds)
    if not rates:
        raise AnelabInputError("no dense family's non-attention to fit the runtime's bandwidth on")
    return float(math.exp(sum(math.log(r) for r in rates) / len(rates)))


def own_non_attention(text: dict, storage: str, prompt_tokens: int, bandwidth: float) -> tuple[float, str]:
    """(seconds, basis) of a checkpoint's non-attention prefill at the recorded runtime's bandwidth."""
    params = active_parameters(text)
    per_weight, how = bytes_per_weight(storage)
    seconds = prompt_tokens * params * per_weight / bandwidth
    basis = (
        f"{params / 1e6:.0f} M active weights x {how} x {prompt_tokens:,} tokens at {bandwidth / 1e9:.0f} GB/s "
        f"(fitted: {RUNTIME})"
    )
    return seconds, basis
