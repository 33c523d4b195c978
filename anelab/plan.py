"""Plan a prefill: which chunks the ANE runs, which sidecar variants load, and whether it pays.

A prompt of ``prompt_tokens`` is cut into chunks of width ``chunk`` starting at 0, C, 2C, ...
A chunk runs on the ANE only if it is a full chunk or a continuation of a long prompt: a prompt
shorter than one chunk is a single partial chunk and stays on the GPU (seed, "When it runs").
Each ANE chunk at start ``s`` calls function ``h<s>`` of every full-attention layer's sidecar,
so it visits one ``(layer, history=s)`` variant per full-attention layer; the functions on hand
(``histories``) give ``coverage = max(histories) + chunk``.

Cost model (seconds; all terms additive)::

    GPU arm = non_attention + sum over chunks, full-attention layers of gpu_attention(chunk)
    ANE arm = non_attention + sum over ANE chunks, layers of ane_attention(chunk)
                            + sum over GPU chunks, layers of gpu_attention(chunk)
                            + setup,   setup = sum over visited variants of load(history)

Attention time is a rate (seconds per score entry) times the score entries of one layer-chunk,
``heads x query rows x keys``:

- ANE (dense graph, padded to the sidecar's width): ``heads x chunk x (history + chunk)`` — the
  score arena (``score_arena_bytes / 2``); a short continuation still costs a full chunk.
- GPU, dense families: ``heads x rows x (history + rows)`` with ``rows`` the chunk's real tokens.
- GPU, sparse-indexed families (``sparse_budget`` B, e.g. Qwen 3.8's QSA indexer, B = 2,051):
  ``heads x rows x min(B, history + rows)`` — the GPU gathers at most B keys per query while the
  ANE scores all of them and masks the rest (seed, "The GPU path is already sparse").

The linear (projection) part of the block is folded into the rate, so a rate fitted at one
workload is an approximation at another. ``non_attention`` scales linearly with prompt tokens from
the family's reference workload (4,333 tokens). ``predicted_ratio = GPU arm / ANE arm`` — the
seed's "Ratio": above 1 the ANE arm is faster, and the decision is ``"ane"``.

Where costs come from (:func:`fit_costs`, reading the records in ``data/``):

- ANE rate: one measured h0 prediction of Qwen 3.8 (0.43 s for 24 x 4,096 x 4,096 entries),
  assumed to hold for every family (all are head_dim 256 here).
- Dense GPU rate and the dense per-variant setup: one weighted least-squares fit over every dense
  A/B row (Qwen 3.5 and the 35B, both widths); each row contributes
  ``gpu - ane = gpu_attention - ane_attention - setup`` (non-attention cancels).
- Sparse GPU rate: the two Qwen 3.8 rows, the same way.
- Loads: Qwen 3.8's three recorded ``MLModel(contentsOf:)`` times where history, chunk and heads
  match; otherwise a power law in score-arena bytes fitted on those three; the 35B's ~0.5 s per
  layer-chunk from the runtime's note; dense Qwen 3.5: the fitted per-variant setup.
- Non-attention: per family, the mean residual of its rows at the reference workload.

:func:`predicted_vs_recorded` reports how well that recovers each recorded ratio, in-sample and
leave-one-out.

What the fit says that the seed does not (read these before trusting a decomposition):

- The dense per-variant setup fits below zero and is pinned at 0: the dense A/B rows leave no room
  for the ~0.5 s per layer-chunk the runtime's note gives the 35B (the 35B keeps its note).
- Qwen 3.8's recorded ANE arm (273.5 s) holds the 244 s of loads only if its non-attention prefill
  is ~5 s, so the fit puts ~186 s of its GPU prefill into sparse attention (a gather rate 3.4x the
  dense GPU rate per score entry). Either the GPU's gather path is that slow, or the recorded ANE
  arm hides part of the loads; the seed does not say which. The verdict does not depend on it:
  the setup alone exceeds the whole GPU prefill.
- Weight precision moves only non-attention: 4-bit and 8-bit of one model share attention rates.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from anelab.errors import AnelabInputError
from anelab.geometry import FP16_BYTES, coverage as _coverage, validate_chunk_and_histories
from anelab.records import read_records

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
REFERENCE_TOKENS = 4333   # the seed's workload: 23,000-character prompt, ~4,333 tokens
REFERENCE_CHUNK = 4096    # the seed's sidecar width
GB = 1e9

RECORDED, DERIVED, ASSUMED, FITTED, UNKNOWN, FLAG = "recorded", "derived", "assumed", "fitted", "unknown", "flag"


# ---- geometry ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanGeometry:
    """What the planner needs of a model: its full-attention layers and their heads.

    ``num_kv_heads`` and ``head_dim`` are carried for the record (None = unknown); the cost model
    uses ``num_heads`` (score entries scale with it). ``sparse_budget`` is the most keys a query
    attends on the GPU's sparse path (None: the GPU path is dense).
    """

    num_layers: int
    full_attention_layers: tuple[int, ...]
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    sparse_budget: int | None = None

    def __post_init__(self):
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "sparse_budget"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, np.integer)) or value <= 0):
                raise AnelabInputError(f"--{_flag(name)} must be a positive integer, got {value}")
        layers = tuple(self.full_attention_layers)
        if not layers:
            raise AnelabInputError("--full-attention-layers must list at least one layer index, e.g. 3,7,11")
        if len(set(layers)) != len(layers):
            raise AnelabInputError(f"--full-attention-layers lists a layer twice: {list(layers)}")
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if bad:
            raise AnelabInputError(
                f"full-attention layers {bad} are outside 0..{self.num_layers - 1}; fix --full-attention-layers or --layers")
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise AnelabInputError(f"--heads ({self.num_heads}) must be a multiple of --kv-heads ({self.num_kv_heads})")
        object.__setattr__(self, "full_attention_layers", tuple(sorted(layers)))

    def score_arena_bytes(self, chunk: int, history: int) -> int:
        """Bytes of the fp16 dense score matrix ``[heads, chunk, history + chunk]`` of one variant."""
        return self.num_heads * chunk * (history + chunk) * FP16_BYTES

    def to_dict(self) -> dict:
        d = asdict(self)
        d["full_attention_layers"] = list(self.full_attention_layers)
        return d


def _flag(name: str) -> str:
    return {"num_layers": "layers", "num_heads": "heads", "num_kv_heads": "kv-heads"}.get(name, name.replace("_", "-"))


def every_fourth(num_layers: int) -> tuple[int, ...]:
    """Full-attention layer indices of a hybrid model with one full-attention layer in four (3, 7, ...)."""
    return tuple(range(3, num_layers, 4))


# ---- score entries ----------------------------------------------------------------------------
def ane_score_entries(geometry: PlanGeometry, chunk: int, history: int) -> int:
    """Score entries of one ANE layer-chunk: the padded dense arena ``heads x chunk x (history+chunk)``."""
    return geometry.num_heads * chunk * (history + chunk)


def gpu_score_entries(geometry: PlanGeometry, rows: int, history: int) -> int:
    """Score entries of one GPU layer-chunk of ``rows`` real tokens (sparse: at most budget keys/query)."""
    keys = history + rows
    if geometry.sparse_budget is not None:
        keys = min(geometry.sparse_budget, keys)
    return geometry.num_heads * rows * keys


# ---- chunks -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chunk:
    """One prefill chunk: ``tokens`` real tokens at absolute ``start``; ``device`` is "ane" or "gpu"."""

    index: int
    start: int
    tokens: int
    device: str

    @property
    def history(self) -> int:
        """Tokens before the chunk, which names the sidecar function (``h<history>``)."""
        return self.start


def chunk_schedule(prompt_tokens: int, chunk: int) -> list[Chunk]:
    """Chunks of a prompt and their device: a prompt shorter than one chunk stays on the GPU."""
    _positive("--prompt-tokens", prompt_tokens)
    _positive("--chunk", chunk)
    on_ane = prompt_tokens >= chunk  # a full first chunk; every later chunk is a continuation
    return [Chunk(i, start, min(chunk, prompt_tokens - start), "ane" if on_ane else "gpu")
            for i, start in enumerate(range(0, prompt_tokens, chunk))]


def _positive(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise AnelabInputError(f"{flag} must be a positive integer, got {value}")


def _positive_seconds(flag: str, value) -> float:
    if value is None or not math.isfinite(float(value)) or float(value) < 0:
        raise AnelabInputError(f"{flag} must be a non-negative number of seconds, got {value}")
    return float(value)


# ---- loads ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadModel:
    """Seconds to load one sidecar variant (``MLModel(contentsOf:)``), by history.

    Lookup order: ``by_history`` (valid only at ``recorded_chunk`` and ``recorded_heads``), then
    ``flat`` (every variant the same), then the power law ``power_coef * (arena / 1e9) ** power_exp``
    in the variant's score-arena bytes.
    """

    by_history: dict[int, float] = field(default_factory=dict)
    recorded_chunk: int | None = None
    recorded_heads: int | None = None
    flat: float | None = None
    power_coef: float | None = None
    power_exp: float | None = None
    source: str = UNKNOWN

    def seconds(self, geometry: PlanGeometry, chunk: int, history: int) -> tuple[float, str]:
        """(seconds, where the number came from) for the variant ``h<history>`` at this chunk."""
        if (history in self.by_history and chunk == self.recorded_chunk
                and geometry.num_heads == self.recorded_heads):
            return self.by_history[history], self.source
        if self.flat is not None:
            return self.flat, self.source
        if self.power_coef is not None:
            arena = geometry.score_arena_bytes(chunk, history)
            return self.power_coef * (arena / GB) ** self.power_exp, "fitted (power law in score-arena bytes)"
        raise AnelabInputError("no load time for this variant; pass --load-seconds")


def fit_load_power(arena_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``log(seconds) = log(coef) + exp * log(arena / 1e9)``; returns (coef, exp)."""
    x = np.log(np.asarray(arena_bytes, dtype=float) / GB)
    y = np.log(np.asarray(seconds, dtype=float))
    if len(x) < 2 or np.ptp(x) == 0:
        raise AnelabInputError("a load fit needs loads at two or more different score-arena sizes")
    exp, log_coef = np.polyfit(x, y, 1)
    return float(np.exp(log_coef)), float(exp)


# ---- families ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """One model family of the seed: geometry, what is recorded vs assumed, and what is unknown.

    ``facts`` maps a geometry field to ``(status, note)`` with status recorded / derived / assumed /
    unknown. ``max_history`` is the largest history known to load on the ANE (None: not recorded).
    """

    name: str
    label: str
    geometry: PlanGeometry
    facts: dict
    max_history: int | None = None
    setup_note_seconds: float | None = None  # a family-specific per-variant setup from a record
    records: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()

    @property
    def model(self) -> str:
        return self.name.rsplit("-", 1)[0]

    @property
    def sparse(self) -> bool:
        return self.geometry.sparse_budget is not None

    def to_dict(self) -> dict:
        return {
            "name": self.name, "label": self.label, "geometry": self.geometry.to_dict(),
            "facts": {k: {"status": s, "note": n} for k, (s, n) in self.facts.items()},
            "max_history": self.max_history, "coverage_cap": None if self.max_history is None else self.max_history + REFERENCE_CHUNK,
            "setup_note_seconds": self.setup_note_seconds, "records": list(self.records), "unknown": list(self.unknown),
        }


_QWEN35_CONFIG = "public Qwen 3.5 config; not stated in the seed"
_DENSE_UNKNOWN = (
    "per-variant load time (not measured: fitted from the A/B rows)",
    "largest history that still lands on the ANE",
    "split of the GPU prefill into attention and non-attention (fitted)",
)


def _qwen35(size: str, bits: int, layers: int, layers_status: str, fa_status: str, heads: int, kv: int) -> Family:
    n_fa = len(every_fourth(layers))
    return Family(
        name=f"qwen3.5-{size.lower()}-{bits}bit", label=f"Qwen 3.5 {size} {bits}-bit",
        geometry=PlanGeometry(layers, every_fourth(layers), heads, kv, 256),
        facts={
            "num_layers": (layers_status, "seed: 'the dense 2B only 6 of 24'" if layers_status == RECORDED else _QWEN35_CONFIG),
            "full_attention_layers": (fa_status, f"{n_fa} layers; indices assume one full-attention layer in four"),
            "num_heads": (ASSUMED, _QWEN35_CONFIG), "num_kv_heads": (ASSUMED, _QWEN35_CONFIG),
            "head_dim": (ASSUMED, _QWEN35_CONFIG), "sparse_budget": (RECORDED, "dense attention (seed: 'dense Qwen 3.5')"),
        },
        records=("v5.5-ane-matrix-3.json",) + (("ane-chunk1024-2b-4bit.json",) if (size, bits) == ("2B", 4) else ()),
        unknown=_DENSE_UNKNOWN + (("head counts and layer count (assumed from public configs)",) if layers_status != RECORDED
                                  else ("head counts (assumed from the public config)",)),
    )


def _qwen38(bits: int) -> Family:
    return Family(
        name=f"qwen3.8-125b-a6b-{bits}bit", label=f"Qwen 3.8 125B-A6B {bits}-bit",
        geometry=PlanGeometry(48, every_fourth(48), 24, None, 256, sparse_budget=2051),
        facts={
            "num_layers": (ASSUMED, "not in the seed; 48 with one full-attention layer in four"),
            "full_attention_layers": (DERIVED, "12: 24 (layer, history) variants at 4,333 tokens / 2 chunks; indices assumed"),
            "num_heads": (RECORDED, "seed: 'the 24-head h12288 variant'"),
            "num_kv_heads": (UNKNOWN, "not in the seed; unused by the cost model"),
            "head_dim": (DERIVED, "256: 103 GB of gathered keys = 24 x 4,096 x 2,051 x head_dim x 2 B"),
            "sparse_budget": (RECORDED, "seed: 2,051 visible keys per query (QSA indexer)"),
        },
        max_history=8192,
        records=(("v5.5-ane-matrix-3.json",) if bits == 4 else ()) + (
            f"v5.6-ane-38-{bits}bit.json", "seed-38-variant-loads.json", "seed-38-h0-ane-vs-cpu.json",
            "seed-op-assignment-counts.json"),
        unknown=("number of layers (assumed 48)", "kv heads",
                 "split of the GPU prefill into sparse attention and non-attention (fitted)",
                 "which precision's sidecar the load times were measured on (the sidecar is fp16 either way)"),
    )


FAMILIES: dict[str, Family] = {f.name: f for f in (
    _qwen35("2B", 4, 24, RECORDED, RECORDED, 8, 2),
    _qwen35("2B", 8, 24, RECORDED, RECORDED, 8, 2),
    _qwen35("4B", 4, 32, ASSUMED, ASSUMED, 16, 4),
    _qwen35("4B", 8, 32, ASSUMED, ASSUMED, 16, 4),
    _qwen35("9B", 4, 32, ASSUMED, ASSUMED, 16, 4),
    _qwen35("9B", 8, 32, ASSUMED, ASSUMED, 16, 4),
    Family(
        name="agentworld-35b-a3b-4bit", label="AgentWorld 35B-A3B 4-bit",
        geometry=PlanGeometry(40, every_fourth(40), 16, 2, 256),
        facts={
            "num_layers": (RECORDED, "seed: 'the 35B offloads 10 of 40 layers'"),
            "full_attention_layers": (RECORDED, "10 layers; indices assume one full-attention layer in four"),
            "num_heads": (ASSUMED, "public Qwen 3.5 35B-A3B config; not stated in the seed"),
            "num_kv_heads": (ASSUMED, "public Qwen 3.5 35B-A3B config; not stated in the seed"),
            "head_dim": (ASSUMED, "public Qwen 3.5 35B-A3B config; not stated in the seed"),
            "sparse_budget": (ASSUMED, "dense attention (the seed calls it a win alongside the dense models)"),
        },
        setup_note_seconds=0.5,
        records=("v5.5-ane-matrix-3.json", "seed-35b-setup-note.json"),
        unknown=("head counts (assumed)", "whether the ~0.5 s setup note is measured, and at which histories",
                 "largest history that still lands on the ANE", "split of the GPU prefill (fitted)"),
    ),
    _qwen38(4),
    _qwen38(8),
)}


def get_family(name: str) -> Family:
    """The family called ``name``; an unknown name lists the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise AnelabInputError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}") from None


def family_table() -> list[dict]:
    """Every family with its geometry, the status of each fact, its records and its unknowns."""
    return [f.to_dict() for f in FAMILIES.values()]


# ---- recorded rows and the fit ----------------------------------------------------------------
@dataclass(frozen=True)
class ABRow:
    """One recorded GPU-vs-ANE prefill (``ane_seconds`` None when only the GPU arm was recorded)."""

    record: str
    family: str
    prompt_tokens: int
    chunk: int
    gpu_seconds: float
    ane_seconds: float | None
    ratio: float | None


@dataclass(frozen=True)
class CostFit:
    """Rates and setups fitted on the records (see the module docstring for the procedure)."""

    ane_seconds_per_entry: float
    gpu_dense_seconds_per_entry: float
    gpu_sparse_seconds_per_entry: float
    dense_setup_seconds_per_variant: float
    load_power_coef: float
    load_power_exp: float
    recorded_loads: dict            # history -> seconds (Qwen 3.8) at recorded_load_chunk, recorded_load_heads
    recorded_load_chunk: int
    recorded_load_heads: int
    non_attention_seconds: dict     # family -> seconds at REFERENCE_TOKENS
    non_attention_clamped: tuple    # families whose fitted non-attention was negative, set to 0
    rows: tuple                     # ABRow used

    def recorded_load_model(self) -> LoadModel:
        """Qwen 3.8's recorded loads where they apply, the power law in score-arena bytes elsewhere."""
        return LoadModel(self.recorded_loads, self.recorded_load_chunk, self.recorded_load_heads,
                         power_coef=self.load_power_coef, power_exp=self.load_power_exp, source=RECORDED)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rows"] = [asdict(r) for r in self.rows]
        d["recorded_loads"] = {str(k): v for k, v in self.recorded_loads.items()}
        d["non_attention_clamped"] = list(self.non_attention_clamped)
        return d


def _load_rows(records: list[dict]) -> list[ABRow]:
    rows = []
    for rec in records:
        if rec["kind"] != "prefill_ab":
            continue
        workload = rec["parameters"]["workload"]
        for r in rec["results"]["rows"]:
            rows.append(ABRow(rec["_file"], r["family"], workload["prompt_tokens_approx"], workload["chunk"],
                              r["gpu_seconds"], r["ane_seconds"], r["ratio"]))
    return rows


def _by_file(records: list[dict], name: str) -> dict:
    for rec in records:
        if rec["_file"] == name:
            return rec
    raise AnelabInputError(f"recorded data {name} is missing from the data folder; restore data/{name}")


@dataclass(frozen=True)
class _RowTerms:
    """Score entries and variants of one recorded row under its family's geometry."""

    gpu_entries: float
    ane_entries: float
    variants: int
    fixed_setup: float | None  # seconds, or None when the setup is the fitted dense per-variant setup


def _row_terms(row: ABRow, recorded_load: LoadModel) -> _RowTerms:
    family = FAMILIES[row.family]
    g = family.geometry
    chunks = [c for c in chunk_schedule(row.prompt_tokens, row.chunk) if c.device == "ane"]
    n_fa = len(g.full_attention_layers)
    gpu = sum(gpu_score_entries(g, c.tokens, c.history) for c in chunks) * n_fa
    ane = sum(ane_score_entries(g, row.chunk, c.history) for c in chunks) * n_fa
    variants = len(chunks) * n_fa
    if family.sparse:
        fixed = n_fa * sum(recorded_load.seconds(g, row.chunk, c.history)[0] for c in chunks)
    elif family.setup_note_seconds is not None:
        fixed = family.setup_note_seconds * variants
    else:
        fixed = None
    return _RowTerms(float(gpu), float(ane), variants, fixed)


def _wls(columns: list[np.ndarray], y: np.ndarray, w: np.ndarray) -> np.ndarray:
    a = np.stack(columns, axis=1) * w[:, None]
    return np.linalg.lstsq(a, y * w, rcond=None)[0]


def _fit(records: list[dict], exclude_ane: tuple[str, str] | None = None) -> CostFit:
    """Fit the cost model; ``exclude_ane`` = (record, family) holds one row's ANE time out."""
    loads = _by_file(records, "seed-38-variant-loads.json")
    chunk_l, heads_l = loads["parameters"]["chunk"], loads["parameters"]["heads"]
    by_history = {int(x["history"]): float(x["seconds"]) for x in loads["results"]["loads"]}
    load_geometry = PlanGeometry(1, (0,), heads_l)
    arenas = [load_geometry.score_arena_bytes(chunk_l, h) for h in by_history]
    coef, exp = fit_load_power(arenas, list(by_history.values()))
    recorded_load = LoadModel(by_history, chunk_l, heads_l, power_coef=coef, power_exp=exp, source=RECORDED)

    h0 = _by_file(records, "seed-38-h0-ane-vs-cpu.json")
    p = h0["parameters"]
    ane_rate = h0["results"]["ane_seconds"] / (p["heads"] * p["chunk"] * (p["history"] + p["chunk"]))

    rows = _load_rows(records)
    paired = [r for r in rows if r.ane_seconds is not None and (r.record, r.family) != exclude_ane]
    terms = {(r.record, r.family): _row_terms(r, recorded_load) for r in rows}

    # dense: gpu - ane + ane_attention + fixed_setup = g * gpu_entries - s * variants (s: Qwen 3.5 only)
    dense = [r for r in paired if not FAMILIES[r.family].sparse]
    t = [terms[(r.record, r.family)] for r in dense]
    y = np.array([r.gpu_seconds - r.ane_seconds + ane_rate * x.ane_entries + (x.fixed_setup or 0.0)
                  for r, x in zip(dense, t)])
    w = np.array([1.0 / r.ane_seconds for r in dense])  # residuals relative to the ANE time ~ ratio error
    e_gpu = np.array([x.gpu_entries for x in t])
    v_fit = np.array([-float(x.variants) if x.fixed_setup is None else 0.0 for x in t])
    if not dense:
        raise AnelabInputError("no dense A/B rows to fit; restore data/v5.5-ane-matrix-3.json")
    g_dense, s_dense = (_wls([e_gpu, v_fit], y, w) if np.any(v_fit) else (_wls([e_gpu], y, w)[0], 0.0))
    if s_dense < 0:  # a negative setup is unphysical: pin it at zero and refit the rate
        s_dense, g_dense = 0.0, _wls([e_gpu], y, w)[0]

    sparse = [r for r in paired if FAMILIES[r.family].sparse]
    if not sparse:
        raise AnelabInputError("no sparse A/B rows to fit; restore data/v5.6-ane-38-*.json")
    t = [terms[(r.record, r.family)] for r in sparse]
    y = np.array([r.gpu_seconds - r.ane_seconds + ane_rate * x.ane_entries + x.fixed_setup for r, x in zip(sparse, t)])
    g_sparse = _wls([np.array([x.gpu_entries for x in t])], y, np.array([1.0 / r.ane_seconds for r in sparse]))[0]

    non_attention, clamped = {}, []
    for name, family in FAMILIES.items():
        gpu_rate = g_sparse if family.sparse else g_dense
        residuals = []
        for r in rows:
            if r.family != name or (r.prompt_tokens, r.chunk) != (REFERENCE_TOKENS, REFERENCE_CHUNK):
                continue
            x = terms[(r.record, r.family)]
            residuals.append(r.gpu_seconds - gpu_rate * x.gpu_entries)
            if r.ane_seconds is not None and (r.record, r.family) != exclude_ane:
                setup = x.fixed_setup if x.fixed_setup is not None else s_dense * x.variants
                residuals.append(r.ane_seconds - ane_rate * x.ane_entries - setup)
        if residuals:
            n = float(np.mean(residuals))
            if n < 0:
                clamped.append(name)
                n = 0.0
            non_attention[name] = n
    return CostFit(float(ane_rate), float(g_dense), float(g_sparse), float(s_dense), coef, exp, by_history,
                   chunk_l, heads_l, non_attention, tuple(clamped), tuple(rows))


@functools.lru_cache(maxsize=8)
def _cached_fit(data_dir: str, exclude_ane: tuple[str, str] | None) -> CostFit:
    directory = Path(data_dir)
    if not directory.is_dir():
        raise AnelabInputError(f"recorded data folder {directory} not found; run from the repository or pass data_dir")
    return _fit(read_records(directory), exclude_ane)


def fit_costs(data_dir: str | Path | None = None) -> CostFit:
    """The cost model fitted on every record in ``data_dir`` (default: the repository's ``data/``)."""
    return _cached_fit(str(Path(data_dir or DATA_DIR).resolve()), None)


def load_fit_report(data_dir: str | Path | None = None) -> list[dict]:
    """Qwen 3.8's recorded loads against the power-law and a linear fit in score-arena bytes."""
    fit = fit_costs(data_dir)
    g = FAMILIES["qwen3.8-125b-a6b-4bit"].geometry
    arenas = np.array([g.score_arena_bytes(REFERENCE_CHUNK, h) for h in fit.recorded_loads], dtype=float)
    seconds = np.array(list(fit.recorded_loads.values()))
    slope, intercept = np.polyfit(arenas / GB, seconds, 1)
    return [{"history": h, "score_arena_gb": float(a / GB), "recorded_seconds": float(s),
             "power_fit_seconds": float(fit.load_power_coef * (a / GB) ** fit.load_power_exp),
             "linear_fit_seconds": float(intercept + slope * a / GB)}
            for h, a, s in zip(fit.recorded_loads, arenas, seconds)]


# ---- costs of one plan ------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanCosts:
    """Costs the planner applies: rates per score entry, loads, non-attention seconds for the prompt."""

    gpu_seconds_per_entry: float
    ane_seconds_per_entry: float
    load: LoadModel
    non_attention_seconds: float
    sources: dict


def _family_costs(family: Family, prompt_tokens: int, fit: CostFit) -> PlanCosts:
    if family.sparse:
        load = fit.recorded_load_model()
        load_source = "recorded per history (seed-38-variant-loads.json); power fit elsewhere"
    elif family.setup_note_seconds is not None:
        load = LoadModel(flat=family.setup_note_seconds, source=RECORDED)
        load_source = "recorded ~0.5 s per layer-chunk (seed-35b-setup-note.json)"
    else:
        load = LoadModel(flat=fit.dense_setup_seconds_per_variant, source=FITTED)
        load_source = "fitted dense per-variant setup (A/B rows)"
    return PlanCosts(
        gpu_seconds_per_entry=fit.gpu_sparse_seconds_per_entry if family.sparse else fit.gpu_dense_seconds_per_entry,
        ane_seconds_per_entry=fit.ane_seconds_per_entry,
        load=load,
        non_attention_seconds=fit.non_attention_seconds[family.name] * prompt_tokens / REFERENCE_TOKENS,
        sources={
            "gpu_attention": ("fitted sparse rate (Qwen 3.8 A/B rows)" if family.sparse else "fitted dense rate (A/B rows)"),
            "ane_attention": "recorded h0 prediction of Qwen 3.8 (0.43 s), per score entry",
            "load": load_source,
            "non_attention": f"fitted at {REFERENCE_TOKENS:,} tokens, scaled linearly to the prompt"
                             + ("; the fit was negative and is clamped to 0" if family.name in fit.non_attention_clamped else ""),
        },
    )


# ---- the plan ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillPlan:
    """The planner's answer for one prompt (see :func:`plan`). ``predicted_ratio`` = GPU / ANE arm."""

    family: str | None
    geometry: dict
    prompt_tokens: int
    chunk: int
    histories: list
    coverage: int
    coverage_needed: int
    fits: bool
    chunks: list
    variants: list
    variants_visited: int
    load_seconds: dict
    setup_seconds: float
    non_attention_seconds: float
    gpu_attention_seconds: float
    ane_attention_seconds: float
    attention_saved_seconds: float
    gpu_prefill_seconds: float
    ane_prefill_seconds: float
    predicted_ratio: float
    decision: str
    reason: str
    keys_per_query: dict
    cost_sources: dict

    def to_dict(self) -> dict:
        return asdict(self)


def _costs_from_flags(geometry: PlanGeometry, chunk: int, histories: list[int], load_seconds, gpu_attention_seconds,
                      ane_attention_seconds, non_attention_seconds, base: PlanCosts | None) -> PlanCosts:
    """Override a family's costs (or supply all of them) from flags; flags are documented in :func:`plan`."""
    given = {"--load-seconds": load_seconds, "--gpu-attention-seconds": gpu_attention_seconds,
             "--ane-attention-seconds": ane_attention_seconds, "--non-attention-seconds": non_attention_seconds}
    if base is None:
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise AnelabInputError(f"without --family, pass {', '.join(missing)} (or choose a --family; see --list-families)")
    sources = dict(base.sources) if base else {}
    gpu_rate = base.gpu_seconds_per_entry if base else 0.0
    ane_rate = base.ane_seconds_per_entry if base else 0.0
    if gpu_attention_seconds is not None:
        gpu_rate = _positive_seconds("--gpu-attention-seconds", gpu_attention_seconds) / gpu_score_entries(geometry, chunk, 0)
        sources["gpu_attention"] = "flag (one layer, full chunk at history 0; scaled by score entries)"
    if ane_attention_seconds is not None:
        ane_rate = _positive_seconds("--ane-attention-seconds", ane_attention_seconds) / ane_score_entries(geometry, chunk, 0)
        sources["ane_attention"] = "flag (one layer, full chunk at history 0; scaled by score entries)"
    load = base.load if base else None
    if load_seconds is not None:
        values = [load_seconds] if isinstance(load_seconds, (int, float)) else list(load_seconds)
        values = [_positive_seconds("--load-seconds", v) for v in values]
        if len(values) == 1:
            load = LoadModel(flat=values[0], source=FLAG)
        elif len(values) == len(histories):
            load = LoadModel(dict(zip(histories, values)), chunk, geometry.num_heads, source=FLAG)
        else:
            raise AnelabInputError(
                f"--load-seconds gives {len(values)} values for {len(histories)} histories; give one value, or one per history")
        sources["load"] = "flag"
    non_attention = base.non_attention_seconds if base else 0.0
    if non_attention_seconds is not None:
        non_attention = _positive_seconds("--non-attention-seconds", non_attention_seconds)
        sources["non_attention"] = "flag (seconds for this prompt)"
    return PlanCosts(gpu_rate, ane_rate, load, non_attention, sources)


def _histories(chunk: int, needed: list[int], histories, max_history, family: Family | None) -> tuple[list[int], str]:
    """The histories on hand and where they came from."""
    if histories is not None and max_history is not None:
        raise AnelabInputError("pass --histories or --max-history, not both")
    cap = family.max_history if family else None
    if max_history is not None:
        if isinstance(max_history, bool) or not isinstance(max_history, (int, np.integer)) or max_history < 0 or max_history % chunk:
            raise AnelabInputError(f"--max-history must be a non-negative multiple of the chunk {chunk}, got {max_history}")
        if cap is not None and max_history > cap:
            raise AnelabInputError(
                f"--max-history {max_history} exceeds {family.name}'s recorded cap {cap} (coverage {cap + chunk:,}): "
                f"larger variants are refused at export; use --max-history {cap}")
        return list(range(0, max_history + 1, chunk)), "max-history"
    if histories is not None:
        hs = validate_chunk_and_histories(chunk, list(histories))
        if cap is not None and max(hs) > cap:
            raise AnelabInputError(f"history {max(hs)} exceeds {family.name}'s recorded cap {cap}; drop it from --histories")
        return hs, "histories"
    top = max(needed) if needed else 0
    if cap is not None and top > cap:
        return list(range(0, cap + 1, chunk)), "family cap"
    return list(range(0, top + 1, chunk)), "default"


def plan(prompt_tokens: int, *, family: str | None = None, chunk: int | None = None,
         histories: Sequence[int] | None = None, max_history: int | None = None,
         num_layers: int | None = None, full_attention_layers: Sequence[int] | None = None,
         num_heads: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None,
         sparse_budget: int | None = None,
         load_seconds: float | Sequence[float] | None = None, gpu_attention_seconds: float | None = None,
         ane_attention_seconds: float | None = None, non_attention_seconds: float | None = None,
         allow_past_coverage: bool = False, data_dir: str | Path | None = None) -> PrefillPlan:
    """Plan the prefill of one prompt and decide ANE offload vs GPU.

    ``family`` supplies geometry and fitted costs (see :data:`FAMILIES`); any geometry or cost
    argument overrides it, and without a family all of them are needed. Cost arguments:
    ``load_seconds`` — one value for every variant, or one per history; ``gpu_attention_seconds``
    / ``ane_attention_seconds`` — one full-attention layer's attention for a full chunk at history
    0 (other layer-chunks scale with their score entries); ``non_attention_seconds`` — the rest of
    this prompt's prefill. ``histories`` defaults to the multiples of ``chunk`` the prompt needs
    (capped at the family's recorded ``max_history``). A prompt past coverage raises
    :class:`AnelabInputError` naming the coverage needed, unless ``allow_past_coverage`` (then the
    plan says ``fits=False`` and stays on the GPU).
    """
    fam = get_family(family) if family is not None else None
    chunk = REFERENCE_CHUNK if chunk is None and fam is not None else chunk
    if chunk is None:
        raise AnelabInputError("pass --chunk (the sidecar's width) or a --family")
    _positive("--prompt-tokens", prompt_tokens)
    _positive("--chunk", chunk)

    base_g = fam.geometry if fam else None
    if base_g is None:
        missing = [f for f, v in (("--layers", num_layers), ("--full-attention-layers", full_attention_layers),
                                  ("--heads", num_heads)) if v is None]
        if missing:
            raise AnelabInputError(f"without --family, pass {', '.join(missing)} (or choose a --family; see --list-families)")
    geometry = PlanGeometry(
        num_layers if num_layers is not None else base_g.num_layers,
        tuple(full_attention_layers) if full_attention_layers is not None else base_g.full_attention_layers,
        num_heads if num_heads is not None else base_g.num_heads,
        num_kv_heads if num_kv_heads is not None else (base_g.num_kv_heads if base_g and num_heads is None else None),
        head_dim if head_dim is not None else (base_g.head_dim if base_g else None),
        sparse_budget if sparse_budget is not None else (base_g.sparse_budget if base_g else None),
    )

    schedule = chunk_schedule(prompt_tokens, chunk)
    ane_chunks = [c for c in schedule if c.device == "ane"]
    needed = [c.history for c in ane_chunks]
    hs, hs_source = _histories(chunk, needed, histories, max_history, fam)
    coverage = _coverage(hs, chunk)
    coverage_needed = (max(needed) + chunk) if needed else 0
    missing_h = sorted(set(needed) - set(hs))
    fits = not missing_h
    if not fits and not allow_past_coverage:
        where = f"; {fam.name}'s recorded cap is --max-history {fam.max_history} (coverage {fam.max_history + chunk:,}), " \
                f"so this prompt must stay on the GPU" if fam and fam.max_history is not None and max(needed) > fam.max_history \
            else f"; use --max-history {max(needed)}"
        raise AnelabInputError(
            f"prompt of {prompt_tokens:,} tokens is past coverage {coverage:,}: it needs coverage {coverage_needed:,} "
            f"(histories {', '.join(str(h) for h in missing_h)} missing){where}")
    if not fits:
        ane_chunks = []
        schedule = [Chunk(c.index, c.start, c.tokens, "gpu") for c in schedule]

    fit = fit_costs(data_dir) if fam is not None else None
    base_costs = _family_costs(fam, prompt_tokens, fit) if fam is not None else None
    costs = _costs_from_flags(geometry, chunk, hs, load_seconds, gpu_attention_seconds, ane_attention_seconds,
                              non_attention_seconds, base_costs)

    layers = geometry.full_attention_layers
    n_fa = len(layers)
    gpu_attn_all = sum(costs.gpu_seconds_per_entry * gpu_score_entries(geometry, c.tokens, c.history) for c in schedule) * n_fa
    gpu_attn_offloaded = sum(costs.gpu_seconds_per_entry * gpu_score_entries(geometry, c.tokens, c.history)
                             for c in ane_chunks) * n_fa
    ane_attn = sum(costs.ane_seconds_per_entry * ane_score_entries(geometry, chunk, c.history) for c in ane_chunks) * n_fa
    load_by_history = {}
    for c in ane_chunks:
        seconds, source = costs.load.seconds(geometry, chunk, c.history)
        load_by_history[str(c.history)] = {"seconds": seconds, "source": source, "score_arena_bytes":
                                           geometry.score_arena_bytes(chunk, c.history)}
    setup = n_fa * sum(v["seconds"] for v in load_by_history.values())
    variants = [[layer, c.history] for layer in layers for c in ane_chunks]

    n = costs.non_attention_seconds
    gpu_total = n + gpu_attn_all
    ane_total = n + gpu_attn_all - gpu_attn_offloaded + ane_attn + setup
    if ane_total <= 0:
        raise AnelabInputError("every cost is zero; pass non-zero --gpu-attention-seconds or --non-attention-seconds")
    ratio = gpu_total / ane_total
    saved = gpu_attn_offloaded - ane_attn
    keys = {"gpu": None, "ane": None}
    if ane_chunks:
        top = max(c.history for c in ane_chunks) + chunk
        keys = {"ane": top, "gpu": min(geometry.sparse_budget, top) if geometry.sparse_budget else top}
    decision = "ane" if ane_chunks and ratio > 1.0 else "gpu"
    reason = _reason(decision, prompt_tokens, chunk, fits, coverage_needed, coverage, setup, saved, gpu_total,
                     gpu_attn_offloaded, ane_attn, len(variants), keys, geometry)
    return PrefillPlan(
        family=fam.name if fam else None, geometry=geometry.to_dict(), prompt_tokens=prompt_tokens, chunk=chunk,
        histories=hs, coverage=coverage, coverage_needed=coverage_needed, fits=fits,
        chunks=[{**asdict(c), "history": c.history} for c in schedule],
        variants=variants, variants_visited=len(variants), load_seconds=load_by_history,
        setup_seconds=setup, non_attention_seconds=n, gpu_attention_seconds=gpu_attn_all,
        ane_attention_seconds=ane_attn, attention_saved_seconds=saved,
        gpu_prefill_seconds=gpu_total, ane_prefill_seconds=ane_total, predicted_ratio=ratio,
        decision=decision, reason=reason, keys_per_query=keys,
        cost_sources={**costs.sources, "histories": hs_source},
    )


def _reason(decision, prompt_tokens, chunk, fits, needed, coverage, setup, saved, gpu_total, gpu_attn, ane_attn,
            n_variants, keys, geometry) -> str:
    """One line naming the dominant term of the decision."""
    if not fits:
        return f"prompt past coverage: needs {needed:,}, the histories give {coverage:,}; it stays on the GPU"
    if n_variants == 0:
        return f"short prompt: {prompt_tokens:,} tokens is one partial chunk of {chunk:,}, which stays on the GPU"
    sparse_note = ""
    if geometry.sparse_budget is not None and keys["ane"] > keys["gpu"]:
        sparse_note = (f"sparse GPU path: the ANE scores {keys['ane'] / keys['gpu']:.1f}x the keys per query "
                       f"({keys['ane']:,} vs {keys['gpu']:,})")
    if decision == "ane":
        text = f"attention time saved {saved:.0f} s exceeds setup {setup:.0f} s ({n_variants} variant loads)"
        return text + (f"; {sparse_note}" if sparse_note else "")
    if saved <= 0:
        head = f"ANE attention {ane_attn:.0f} s is no faster than the GPU's {gpu_attn:.0f} s"
        return f"{sparse_note}: {head}" if sparse_note else head
    text = f"setup {setup:.0f} s ({n_variants} variant loads) exceeds attention time saved {saved:.0f} s"
    if setup > gpu_total:
        text += f" and the whole GPU prefill {gpu_total:.0f} s"
    return text + (f"; {sparse_note}" if sparse_note else "")


# ---- how well the fit recovers the records ----------------------------------------------------
def _predicted_ane(row: ABRow, fit: CostFit) -> tuple[float, bool]:
    """ANE-arm seconds for a recorded row given its measured GPU seconds; True if non-attention clamped."""
    family = FAMILIES[row.family]
    x = _row_terms(row, fit.recorded_load_model())
    gpu_rate = fit.gpu_sparse_seconds_per_entry if family.sparse else fit.gpu_dense_seconds_per_entry
    setup = x.fixed_setup if x.fixed_setup is not None else fit.dense_setup_seconds_per_variant * x.variants
    n = row.gpu_seconds - gpu_rate * x.gpu_entries
    return max(n, 0.0) + fit.ane_seconds_per_entry * x.ane_entries + setup, n < 0


def predicted_vs_recorded(data_dir: str | Path | None = None) -> list[dict]:
    """Each recorded ratio against the model's prediction, three ways.

    - ``in_sample``: the fit uses every row (this one included); the prediction takes the row's
      measured GPU seconds as given and predicts its ANE seconds.
    - ``leave_one_out``: the same, with the row's ANE time held out of the fit.
    - ``plan``: what :func:`plan` says for the family at the row's prompt and chunk (non-attention
      from the family fit, scaled by tokens) — no measured time of the row as input.
    Errors are (predicted - recorded) / recorded.
    """
    directory = str(Path(data_dir or DATA_DIR).resolve())
    fit = _cached_fit(directory, None)
    out = []
    for row in fit.rows:
        if row.ane_seconds is None:
            continue
        pred_in, clamped_in = _predicted_ane(row, fit)
        pred_loo, clamped_loo = _predicted_ane(row, _cached_fit(directory, (row.record, row.family)))
        planned = plan(row.prompt_tokens, family=row.family, chunk=row.chunk, data_dir=directory).predicted_ratio
        r_in, r_loo = row.gpu_seconds / pred_in, row.gpu_seconds / pred_loo
        out.append({
            "family": row.family, "record": row.record, "prompt_tokens": row.prompt_tokens, "chunk": row.chunk,
            "recorded_ratio": row.ratio,
            "in_sample_ratio": r_in, "in_sample_error": (r_in - row.ratio) / row.ratio,
            "leave_one_out_ratio": r_loo, "leave_one_out_error": (r_loo - row.ratio) / row.ratio,
            "plan_ratio": planned, "plan_error": (planned - row.ratio) / row.ratio,
            "non_attention_clamped": clamped_in or clamped_loo,
        })
    return out
