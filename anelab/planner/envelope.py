"""Where the cost model stands on records: each plan input's source, its interval, and the records' range.

Every cost a plan applies is one of five kinds (``KINDS``):

- ``recorded``: a number the seeds measured, used where it was measured (same geometry, arena,
  prompt and chunk);
- ``fitted``: a law fitted on records, used inside the range they cover;
- ``extrapolated``: the same law outside that range (another geometry, a score arena past the
  recorded ones, a prompt length or chunk no record has);
- ``yours``: a number the user supplied (``--gpu-prefill-seconds``, ``--load-seconds``, ...);
- ``measured``: a record measured on this Mac from the user's own packages.

Intervals (``Cost.low`` .. ``Cost.high``):

- loads: the power law in score-arena bytes misses each of Qwen 3.8's three recorded loads, when
  fitted on the other two, by ``load_log_loo_residuals``; the band is x/÷ exp(max |residual|);
- GPU prefill: the fit's leave-one-out error of every recorded A/B ratio of the same kind of GPU
  path (dense or sparse), max |error|, applied to the GPU arm;
- ANE attention: one recorded prediction, no residual to size a band with: x/÷ ``ANE_RATE_BAND``
  once extrapolated (stated as an assumption);
- recorded, yours and measured numbers are points (the seeds print no spread; the user's number is
  theirs; a measured record carries its own min/max, used as the band).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from anelab.core.paths import DATA_DIR
from anelab.planner.catalogue import EXTRAPOLATED, FAMILIES, FITTED, RECORDED, PlanGeometry
from anelab.planner.fit import CostFit, cached_fit, ratio_under, timed_ab_rows

YOURS, MEASURED = "yours", "measured on this Mac"
KINDS = (RECORDED, FITTED, EXTRAPOLATED, YOURS, MEASURED)
ANE_RATE_BAND = 2.0  # assumed x/÷ band of the ANE rate per score entry away from its one recorded geometry


@dataclass(frozen=True)
class Cost:
    """One cost in seconds with its interval and provenance (``kind`` in ``KINDS``; ``basis``: how it was
    obtained, in words)."""

    value: float
    low: float
    high: float
    kind: str
    basis: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"cost kind {self.kind!r} is not one of {KINDS}")
        if not (0 <= self.low <= self.value <= self.high) or not math.isfinite(self.high):
            raise ValueError(f"cost interval must hold its value: {self.low} <= {self.value} <= {self.high}")

    @classmethod
    def point(cls, value: float, kind: str, basis: str) -> Cost:
        return cls(float(value), float(value), float(value), kind, basis)

    @classmethod
    def band(cls, value: float, factor: float, kind: str, basis: str) -> Cost:
        """``value`` x/÷ ``factor`` (factor >= 1)."""
        return cls(float(value), float(value) / factor, float(value) * factor, kind, basis)

    def scaled(self, factor: float) -> Cost:
        return Cost(self.value * factor, self.low * factor, self.high * factor, self.kind, self.basis)

    def to_dict(self) -> dict:
        return asdict(self)


def kind_of(source: str) -> str:
    """The kind of a plan's cost-source text ("recorded ...", "fitted (...)", "flag", ...)."""
    for kind in (EXTRAPOLATED, FITTED, RECORDED):
        if source.startswith(kind):
            return kind
    if source.startswith("flag") or source.startswith(YOURS):
        return YOURS
    if source.startswith("measured"):
        return MEASURED
    raise ValueError(f"cost source {source!r} names no kind")


def worst_kind(kinds) -> str:
    """The least certain of several kinds (extrapolated > fitted > recorded; yours / measured are points)."""
    kinds = set(kinds)
    for kind in (EXTRAPOLATED, FITTED, MEASURED, YOURS, RECORDED):
        if kind in kinds:
            return kind
    raise ValueError("no kinds given")


# ---- intervals from the records ----------------------------------------------------------------------
def load_band_factor(fit: CostFit) -> float:
    """x/÷ factor of a load from the power law: exp of its largest leave-one-out miss (log space)."""
    return float(math.exp(max(abs(r) for r in fit.load_log_loo_residuals)))


def leave_one_out_errors(data_dir: str | Path | None = None) -> list[dict]:
    """Each recorded A/B ratio against the fit that held its ANE time out: (family, sparse, error)."""
    directory, _, rows = timed_ab_rows(data_dir)
    out = []
    for row in rows:
        ratio = ratio_under(row, cached_fit(directory, (row.record, row.family)))
        out.append({"family": row.family, "sparse": FAMILIES[row.family].sparse, "error": ratio / row.ratio - 1})
    return out


def gpu_band_fraction(sparse: bool, data_dir: str | Path | None = None) -> float:
    """Relative half-width of a fitted GPU arm: max |leave-one-out ratio error| over rows of its kind."""
    return _gpu_band_fraction(sparse, str(Path(data_dir or DATA_DIR).resolve()))


@functools.lru_cache(maxsize=8)
def _gpu_band_fraction(sparse: bool, directory: str) -> float:
    return max(abs(r["error"]) for r in leave_one_out_errors(directory) if r["sparse"] == sparse)


@dataclass(frozen=True)
class RecordedRange:
    """What the GPU rows of one kind of GPU path cover: prompt tokens and chunks (inclusive ranges)."""

    prompt_tokens: tuple[int, int]
    chunk: tuple[int, int]

    def covers(self, prompt_tokens: int, chunk: int) -> bool:
        return (
            self.prompt_tokens[0] <= prompt_tokens <= self.prompt_tokens[1] and self.chunk[0] <= chunk <= self.chunk[1]
        )


def gpu_recorded_range(fit: CostFit, sparse: bool) -> RecordedRange:
    rows = [r for r in fit.rows if FAMILIES[r.family].sparse == sparse]
    tokens, chunks = [r.prompt_tokens for r in rows], [r.chunk for r in rows]
    return RecordedRange((min(tokens), max(tokens)), (min(chunks), max(chunks)))


def gpu_kind(family: str | None, geometry: PlanGeometry, prompt_tokens: int, chunk: int, fit: CostFit) -> str:
    """``fitted`` when the family's own geometry is planned inside the prompt and chunk range of the
    GPU rows of its kind; ``extrapolated`` otherwise (another model's geometry, another workload)."""
    if family is None:
        return EXTRAPOLATED
    fam = FAMILIES[family]
    own = (geometry.num_heads, geometry.full_attention_layers) == (
        fam.geometry.num_heads,
        fam.geometry.full_attention_layers,
    ) and geometry.head_dim in (None, fam.geometry.head_dim)
    inside = gpu_recorded_range(fit, fam.sparse).covers(prompt_tokens, chunk)
    return FITTED if own and inside else EXTRAPOLATED


def ane_kind(geometry: PlanGeometry, chunk: int, fit: CostFit) -> str:
    """The ANE rate per score entry was recorded once: Qwen 3.8's h0 at its heads, head_dim and chunk."""
    same = (geometry.num_heads, chunk) == (fit.recorded_load_heads, fit.recorded_load_chunk) and geometry.head_dim in (
        None,
        fit.recorded_load_head_dim,
    )
    return RECORDED if same else EXTRAPOLATED
