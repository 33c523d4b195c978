"""mlx-lm's GPU prefill from public measurements: a fraction of the chip's peak, fitted across models and chips.

mlx-lm prefills a prompt in steps of ``PREFILL_STEP`` tokens (``generate_step(prefill_step_size=2048)``),
each step one batched forward: its linear layers are matmuls over every row (compute-bound, unlike a path
that streams the weights once per token), its attention MLX's fused ``scaled_dot_product_attention`` with a
causal mask, whose Metal kernel stops each query block at the diagonal (``kb_lim`` in MLX's
``steel_attention.h``), so a step of ``r`` rows at history ``h`` scores ``r x (h + (r + 1) / 2)`` entries per
head — every key of the history, half the step's own square. A windowed layer's mask is an array (no early
stop): ``r x min(window, h + r)`` entries. The logits head runs on the last token only (mlx-lm PR #406).

``MLX_LM_RECORDS`` are prefill speeds published with the mlx-lm command and the chip; each record's
matmul FLOPs per second over the chip's GPU figure (``planner.chips``) is its *efficiency*. The fitted
efficiency is their geometric mean; the band is the largest factor by which a record sits off it; the
leave-one-out error is each record predicted from the others. The model configurations are the public
config.json values (hidden, layers, heads, KV heads, head_dim, MLP width; Qwen3-30B-A3B: 128 experts,
8 per token, width 768); a record's precision (4-bit, bf16) is not modelled — dequantization is inside the
efficiency, which is why it is a fit and not a peak.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from anelab.core.errors import AnelabInputError
from anelab.planner.chips import get_chip
from anelab.planner.gpu_model import active_parameters

PREFILL_STEP = 2048  # mlx_lm.generate's prefill_step_size default
RUNTIME = "mlx-lm"


@dataclass(frozen=True)
class PublicPrefill:
    """One published mlx-lm prefill: ``tokens_per_second`` over a ``prompt_tokens`` prompt on ``chip``."""

    model: str
    config: dict  # config.json's hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, ...
    chip: str
    prompt_tokens: int
    tokens_per_second: float
    source: str


def _cfg(hidden, layers, heads, kv, head_dim, width, **moe) -> dict:
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": head_dim, "intermediate_size": width, **moe}  # fmt: skip


_GEMMA3_270M = _cfg(640, 18, 4, 1, 256, 2048)
QWEN3_06B = _cfg(1024, 28, 16, 8, 128, 3072)
_QWEN3_30B_A3B = _cfg(2048, 48, 32, 4, 128, 6144, num_experts_per_tok=8, moe_intermediate_size=768)
_PR406 = "https://github.com/ml-explore/mlx-lm/pull/406 (M4 Max, after the change)"

MLX_LM_RECORDS: tuple[PublicPrefill, ...] = (
    PublicPrefill("Gemma3 270M", _GEMMA3_270M, "M4 Max", 2048, 28079.604, _PR406),
    PublicPrefill("Qwen3 0.6B Q4", QWEN3_06B, "M4 Max", 2048, 10278.775, _PR406),
    PublicPrefill("Qwen3 30B A3B Q4", _QWEN3_30B_A3B, "M4 Max", 2048, 1731.991, _PR406),
    PublicPrefill("Gemma3 270M", _GEMMA3_270M, "M4 Max", 512, 24566.622, _PR406),
    PublicPrefill("Qwen3 0.6B Q4", QWEN3_06B, "M4 Max", 512, 9520.375, _PR406),
    PublicPrefill("Qwen3 30B A3B Q4", _QWEN3_30B_A3B, "M4 Max", 512, 1480.329, _PR406),
    PublicPrefill("Qwen3-4B-Instruct-2507 4-bit", _cfg(2560, 36, 32, 8, 128, 9728), "M3 Pro", 2048, 615.28,
                  "https://github.com/ml-explore/mlx-lm/pull/1569 (mlx_lm.benchmark -p 2048, 5 trials)"),
    PublicPrefill("Mistral 7B 4-bit", _cfg(4096, 32, 32, 8, 128, 14336), "M2 Ultra", 33898, 869.279,
                  "https://github.com/ml-explore/mlx-lm/pull/40 (after the causal-mask change)"),
    PublicPrefill("Llama-3.3-70B-Instruct 4-bit", _cfg(8192, 80, 64, 8, 128, 28672), "M3 Max", 4126, 79.410,
                  "https://github.com/ml-explore/mlx-examples/issues/1029 (mlx-lm 0.20.4)"),
)  # fmt: skip


def causal_step_entries(prompt_tokens: int, history: int = 0, window: int | None = None) -> int:
    """Score entries per head per layer of mlx-lm's prefill of ``prompt_tokens`` after ``history`` tokens,
    in steps of ``PREFILL_STEP``: causal ``r x (h + (r + 1) // 2)``, or windowed ``r x min(window, h + r)``."""
    entries, h, left = 0, history, prompt_tokens
    while left > 0:
        r = min(PREFILL_STEP, left)
        entries += r * min(window, h + r) if window is not None else r * (h + (r + 1) // 2)
        h, left = h + r, left - r
    return entries


def prefill_flops(active_weights: float, head_dim: int, heads: int, attention_layers: int, prompt_tokens: int,
                  window: int | None = None) -> tuple[float, float]:  # fmt: skip
    """(linear, attention) matmul FLOPs of mlx-lm's prefill: ``2 x active weights x tokens`` and ``4 x head_dim``
    per score entry (QK^T and PV) over ``heads x attention_layers`` of :func:`causal_step_entries`."""
    linear = 2.0 * active_weights * prompt_tokens
    entries = causal_step_entries(prompt_tokens, window=window)
    return linear, 4.0 * head_dim * heads * attention_layers * float(entries)


def record_efficiency(r: PublicPrefill) -> float:
    """FLOPs per second of a record over its chip's GPU figure."""

    c = r.config
    linear, attention = prefill_flops(active_parameters(c), c["head_dim"], c["num_attention_heads"],
                                      c["num_hidden_layers"], r.prompt_tokens)  # fmt: skip
    seconds = r.prompt_tokens / r.tokens_per_second
    return (linear + attention) / seconds / peak_flops(r.chip)


def peak_flops(chip: str) -> float:
    """The chip's GPU FP16 figure in FLOP/s (``planner.chips``), refused where the table has none."""

    c = get_chip(chip)
    if c.gpu_fp16_tflops.value is None:
        raise AnelabInputError(f"--chip {chip}: no GPU throughput figure for {c.name}; mlx-lm cannot be priced on it")
    return c.gpu_fp16_tflops.value * 1e12


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


@dataclass(frozen=True)
class MlxLmFit:
    efficiency: float  # geometric mean over the records
    band: float  # x/÷: the largest factor a record sits off the fit
    records: list  # per record: model, chip, prompt_tokens, tokens_per_second, efficiency, held_out_error, source

    def to_dict(self) -> dict:
        return {"efficiency": self.efficiency, "band": self.band, "records": self.records}


@functools.lru_cache(maxsize=4)
def fit_mlx_lm(records: tuple[PublicPrefill, ...] = MLX_LM_RECORDS) -> MlxLmFit:
    """The fitted efficiency, its band, and each record predicted from the others (ratio error)."""
    effs = [record_efficiency(r) for r in records]
    fit = _geomean(effs)
    rows = []
    for i, (r, e) in enumerate(zip(records, effs)):
        others = _geomean(x for j, x in enumerate(effs) if j != i) if len(effs) > 1 else e
        rows.append({"model": r.model, "chip": r.chip, "prompt_tokens": r.prompt_tokens,
                     "tokens_per_second": r.tokens_per_second, "efficiency": e,
                     "held_out_error": others / e - 1.0, "source": r.source})  # fmt: skip
    return MlxLmFit(fit, max(max(effs) / fit, fit / min(effs)), rows)


def format_mlx_lm_fit(fit: MlxLmFit) -> str:
    lines = [
        f"mlx-lm prefill: {fit.efficiency:.3f} of the chip's GPU figure (geometric mean of {len(fit.records)} public "
        f"records), x/÷ {fit.band:.2f} (the farthest record)",
        f"{'model':30s} {'chip':9s} {'tokens':>7s} {'tok/s':>9s} {'of peak':>8s} {'held out':>9s}  source",
    ]
    for r in fit.records:
        lines.append(f"{r['model']:30s} {r['chip']:9s} {r['prompt_tokens']:7,d} {r['tokens_per_second']:9,.0f} "
                     f"{r['efficiency']:8.3f} {r['held_out_error']:+9.1%}  {r['source']}")  # fmt: skip
    return "\n".join(lines)
