"""The published ANE/GPU prefill splits (oMLX, mlx-serve) beside the planner's prediction for each, or why it has none.

Each row is one public measurement: the source, the model, the chip, the prompt length, the split (which parts, at
which ANE share) and the published number as a ratio of prefill throughput (split / all-GPU = all-GPU time / split
time, the planner's ratio). The figures are the ones anelab issue 43 quotes, checked against the threads where the
search tool could read them (Dec 2026): oMLX's dual-ANE/GPU prefill of Qwen3.8-27B sends a share of every MLP's and
every Gated DeltaNet layer's input projections to the ANE *while the GPU computes the rest* (a row split, not an
offload), at ``fraction`` 0.53 by default (#2781, #2874); mlx-serve does the same at a share of 0.45 (#223).

The model: Qwen3.8-27B as the threads state it — hidden 5,120, MLP width 17,408, 64 layers (#2781), 16 of them full
attention with 24 query heads, 4 KV heads and head_dim 256 (oMLX's memory monitor log, #3117) — and its 48 GDN
layers' projection width derived from mlx-serve's reported ANE bytes (#223: 9,468,641,280 int8 bytes at share 0.45
for 64 MLPs and 48 GDN layers: (bytes / 0.45 - 64 x 3 x 5,120 x 17,408) / (48 x 5,120) ~ 16,000 channels).

What the planner does not model, stated per row: int8 (or 4-bit) weights on the ANE (priced as fp16), two Neural
Engines (an Ultra's ANE figure is unknown), the GPU runtime's own speed (oMLX's and mlx-serve's kernels are priced
as mlx-lm's), and thermal drift between runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from anelab.core.errors import AnelabInputError
from anelab.planner.offload_split import MLP, PROJECTIONS, ModelSizes, offload_splits, shared_split, sizes_split_inputs

OMLX_DOC = "https://github.com/jundot/omlx/blob/main/docs/experimental/qwen35_ane_prefill.md"
OMLX_M3_MAX = "https://github.com/jundot/omlx/issues/2781"
OMLX_M5_PRO = "https://github.com/jundot/omlx/pull/3604"
MLX_SERVE = "https://github.com/ddalcu/mlx-serve/pull/223"
OMLX_LOG = "https://github.com/jundot/omlx/issues/3117"
ANE_SHAPE = 2048  # oMLX's compiled ANE sequence length (#2760, #3604)

# (bytes / share - MLP weights) / (GDN layers x hidden), from mlx-serve's /props.ane (#223)
_GDN_WIDTH = round((9_468_641_280 / 0.45 - 64 * 3 * 5120 * 17408) / (48 * 5120), -3)

QWEN38_27B = ModelSizes(
    name="Qwen3.8-27B",
    hidden=5120,
    layers=64,
    full_attention_layers=tuple(range(3, 64, 4)),  # one layer in four (16 KV-cache layers, #3117)
    heads=24,
    kv_heads=4,
    head_dim=256,
    intermediate=17408,
    gdn_layers=48,
    gdn_out_width=int(_GDN_WIDTH),
    source=f"{OMLX_M3_MAX} (hidden, MLP width, layers); {OMLX_LOG} (attention); GDN width derived from {MLX_SERVE}",
)


@dataclass(frozen=True)
class PublishedSplit:
    """One published split: ``fractions`` part -> ANE share; ``published`` the ratio (or its ``low`` .. ``high``)."""

    source: str
    runtime: str
    model: ModelSizes
    chip: str
    prompt_tokens: int
    fractions: dict
    published: float
    published_low: float | None = None
    published_high: float | None = None
    note: str = ""


PUBLISHED_SPLITS: tuple[PublishedSplit, ...] = (
    PublishedSplit(OMLX_DOC, "oMLX 0.6.1 (dual ANE)", QWEN38_27B, "M3 Ultra", 16384, {MLP: 0.53, PROJECTIONS: 0.5},
                   1.178, note="+17.8 % prefill at 16K (issue 43's figure; oMLX's default fraction 0.53)"),
    PublishedSplit(OMLX_DOC, "oMLX 0.6.1 (dual ANE)", QWEN38_27B, "M3 Ultra", 32768, {MLP: 0.53, PROJECTIONS: 0.5},
                   1.189, note="+18.9 % prefill at 32K (issue 43's figure; the 0.6.1 release note)"),
    PublishedSplit(OMLX_M3_MAX, "oMLX 0.6.2", QWEN38_27B, "M3 Max", 16384, {MLP: 0.53, PROJECTIONS: 0.5},
                   258 / 212, note="212 -> 258 tok/s at 16K (fraction 0.53, GDN fraction 0.5)"),
    PublishedSplit(OMLX_M5_PRO, "oMLX (single ANE)", QWEN38_27B, "M5 Pro", 2048, {MLP: 0.35, PROJECTIONS: 0.375},
                   (1.07 * 1.27) ** 0.5, 1.07, 1.27,
                   note="1.07-1.27x at 2,048 tokens over MLP shares 0.15-0.45 (balance near 0.35; the range's "
                   "geometric middle stands for it, not a published value), GDN share 0.375"),
    PublishedSplit(MLX_SERVE, "mlx-serve (channel split)", QWEN38_27B, "M5 Max", 16384, {MLP: 0.45, PROJECTIONS: 0.45},
                   1 - 0.114, note="-11.4 % median at 16K (share 0.45; thermal drift between runs noted)"),
)  # fmt: skip


def replay(row: PublishedSplit) -> dict:
    """The row beside the planner: its prediction for the published split (shared by rows at the published shares),
    the planner's own best split for that model, prompt and chip — or, where it cannot price it, why."""
    out = {**asdict(row), "model": row.model.name}
    try:
        inputs = sizes_split_inputs(row.model, row.prompt_tokens, ANE_SHAPE, row.chip)
        predicted = shared_split(inputs, row.fractions)
        best = offload_splits(inputs)[0]
    except AnelabInputError as e:
        return {**out, "predicted": None, "why_not": str(e)}
    return {
        **out,
        "predicted": predicted.ratio,
        "predicted_low": predicted.ratio_low,
        "predicted_high": predicted.ratio_high,
        "decided_by": predicted.decided_by,
        "best_split": best.name,
        "best_ratio": best.ratio,
        "why_not": None,
    }


def published_vs_predicted() -> list[dict]:
    return [replay(row) for row in PUBLISHED_SPLITS]


def format_published(rows: list[dict]) -> str:
    """The table as text: source, chip, prompt, split, published and predicted ratios (or why not)."""
    lines = [f"{'runtime':26s} {'chip':8s} {'tokens':>6s} {'split':28s} {'published':>10s}  predicted"]
    for r in rows:
        split = " + ".join(f"{k}@{v:.2f}" for k, v in r["fractions"].items())
        pub = f"{r['published']:.2f}x" if r["published_low"] is None else (
            f"{r['published_low']:.2f}-{r['published_high']:.2f}x")  # fmt: skip
        pred = (f"{r['predicted']:.2f}x [{r['predicted_low']:.2f} .. {r['predicted_high']:.2f}]; planner's best: "
                f"{r['best_split']} {r['best_ratio']:.2f}x" if r["predicted"] is not None
                else f"not predicted: {r['why_not']}")  # fmt: skip
        lines.append(f"{r['runtime']:26s} {r['chip']:8s} {r['prompt_tokens']:6d} {split:28s} {pub:>10s}  {pred}")
        lines.append(f"{'':26s} source: {r['source']} — {r['note']}")
    return "\n".join(lines)
