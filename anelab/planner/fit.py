"""The planner's cost fit: per-token costs and the load model fitted on the seeds' records."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import GB, score_arena_bytes
from anelab.core.paths import DATA_DIR
from anelab.core.records import read_records
from anelab.planner.catalogue import (
    EXTRAPOLATED,
    FAMILIES,
    FITTED,
    RECORDED,
    REFERENCE_CHUNK,
    REFERENCE_TOKENS,
    UNKNOWN,
    PlanGeometry,
    ane_score_entries,
    chunk_schedule,
    gpu_score_entries,
)
from anelab.planner.loads import (
    DEFAULT_PROTOCOL,
    RELOAD_NOTE_SECONDS,
    SPECIALIZATION_NOTE_SECONDS,
    TINYTITAN_NOTE,
    fit_specialization,
    note_arenas,
    pays_specialization,
    reload_anchor_bytes,
)


# ---- loads ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadModel:
    """Seconds to load one sidecar function (``MLModel(contentsOf:)``), by its score arena.

    Lookup order: ``by_history`` (valid only at ``recorded_chunk`` and ``recorded_heads``), then
    ``flat`` (every variant the same), then the power law ``power_coef * (arena / 1e9) ** power_exp``
    in the function's score-arena bytes — the one load model every design is priced with, so the same
    arena costs the same whichever design holds it. ``recorded_arenas`` (bytes, with ``by_history``)
    mark where the law is "fitted" (inside their range, at the recorded heads / head_dim / chunk)
    and where it is "extrapolated"; ``floor_seconds`` is the smallest load ever recorded (a
    function cannot be priced below it however small its arena).
    """

    by_history: dict[int, float] = field(default_factory=dict)
    recorded_chunk: int | None = None
    recorded_heads: int | None = None
    flat: float | None = None
    power_coef: float | None = None
    power_exp: float | None = None
    source: str = UNKNOWN
    recorded_head_dim: int | None = None
    floor_seconds: float | None = None
    reload_seconds_per_byte: float = 0.0  # the reload's price per score-arena byte (``planner.loads``)
    specialize: bool = True  # the price includes the function's specialization (the protocol pays it)

    def seconds(self, geometry: PlanGeometry, chunk: int, history: int) -> tuple[float, str]:
        """(seconds, where the number came from) for the variant ``h<history>`` at this chunk."""
        recorded_here = chunk == self.recorded_chunk and geometry.num_heads == self.recorded_heads
        if history in self.by_history and recorded_here and self.specialize:
            return self.by_history[history], self.source
        if self.flat is not None:
            return self.flat, self.source
        return self.at_arena(geometry.num_heads, geometry.head_dim, chunk, geometry.score_arena_bytes(chunk, history))

    def at_arena(self, num_heads: int, head_dim: int | None, chunk: int, arena_bytes: int) -> tuple[float, str]:
        """(seconds, source) of a function whose score arena is ``arena_bytes`` (any design): the
        recorded load of that arena at the recorded geometry, else the power law — "fitted" inside
        the recorded arenas at the recorded heads, head_dim and chunk, "extrapolated" elsewhere."""
        same_geometry = (num_heads, chunk) == (self.recorded_heads, self.recorded_chunk) and head_dim in (
            None,
            self.recorded_head_dim,
        )
        reload = self.reload_seconds_per_byte * arena_bytes
        if same_geometry and self.specialize:
            for history, seconds in self.by_history.items():
                if score_arena_bytes(num_heads, chunk, history) == arena_bytes:
                    return seconds, self.source
        if self.flat is not None:
            return self.flat, self.source
        if not self.specialize:
            return reload, f"{FITTED} (reload in proportion to the score arena, specialization cached)"
        if self.power_coef is None:
            raise AnelabInputError("no load time for this variant; pass --load-seconds")
        seconds = self.power_coef * (arena_bytes / GB) ** self.power_exp + reload
        if self.floor_seconds is not None and seconds < self.floor_seconds:
            return self.floor_seconds, f"{EXTRAPOLATED} (arena fit below the smallest recorded load: floored there)"
        arenas = [score_arena_bytes(self.recorded_heads, self.recorded_chunk, h) for h in self.by_history]
        inside = bool(arenas) and min(arenas) <= arena_bytes <= max(arenas)
        return (
            seconds,
            f"{FITTED if inside else EXTRAPOLATED} (specialization power law + reload, in score-arena bytes)",
        )


def fit_load_power(arena_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``log(seconds) = log(coef) + exp * log(arena / 1e9)``; returns (coef, exp)."""
    x = np.log(np.asarray(arena_bytes, dtype=float) / GB)
    y = np.log(np.asarray(seconds, dtype=float))
    if len(x) < 2 or np.ptp(x) == 0:
        raise AnelabInputError("a load fit needs loads at two or more different score-arena sizes")
    exp, log_coef = np.polyfit(x, y, 1)
    return float(np.exp(log_coef)), float(exp)


def _loo_log_residuals(arena_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, ...]:
    """ln(recorded / predicted) of each recorded load, predicted by the power law fitted on the others."""
    out = []
    for i in range(len(seconds)):
        keep = [j for j in range(len(seconds)) if j != i]
        coef, exp = fit_load_power([arena_bytes[j] for j in keep], [seconds[j] for j in keep])
        out.append(float(np.log(seconds[i] / (coef * (arena_bytes[i] / GB) ** exp))))
    return tuple(out)


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

    def identity(self) -> dict:
        """The row as every re-prediction of it names it: family, record, prompt, chunk and recorded ratio."""
        return {"family": self.family, "record": self.record, "prompt_tokens": self.prompt_tokens,
                "chunk": self.chunk, "recorded_ratio": self.ratio}  # fmt: skip


@dataclass(frozen=True)
class CostFit:
    """Rates and loads fitted on the records (see ``_fit`` for the procedure).

    ``load_power_coef`` / ``load_power_exp``: the specialization law in score-arena bytes;
    ``reload_seconds_per_gb``: the reload's price; both arena-only (``planner.loads``)."""

    ane_seconds_per_entry: float
    gpu_dense_seconds_per_entry: float
    gpu_sparse_seconds_per_entry: float
    load_power_coef: float
    load_power_exp: float
    recorded_loads: dict  # history -> seconds (Qwen 3.8, cold) at recorded_load_chunk, recorded_load_heads
    recorded_load_chunk: int
    recorded_load_heads: int
    recorded_load_head_dim: int
    min_recorded_load_seconds: float  # the smallest load any record holds (data/ane-gather-probe.json)
    load_log_loo_residuals: tuple  # leave-one-out residuals of the specialization law, ln(recorded / predicted)
    non_attention_seconds: dict  # family -> seconds at REFERENCE_TOKENS
    non_attention_clamped: tuple  # families whose fitted non-attention was negative, set to 0
    rows: tuple  # ABRow used
    reload_seconds_per_gb: float = 0.0
    reload_basis: str = ""
    held_out: str | None = None  # the model whose rows and load records this fit did not see

    def recorded_load_model(self, specialize: bool = False) -> LoadModel:
        """The one load model: reload in proportion to the arena, plus (``specialize``) the specialization
        law — Qwen 3.8's recorded cold loads where arena, chunk and heads match."""
        return LoadModel(
            self.recorded_loads,
            self.recorded_load_chunk,
            self.recorded_load_heads,
            power_coef=self.load_power_coef,
            power_exp=self.load_power_exp,
            source=RECORDED,
            recorded_head_dim=self.recorded_load_head_dim,
            floor_seconds=self.min_recorded_load_seconds if specialize else None,
            reload_seconds_per_byte=self.reload_seconds_per_gb / GB,
            specialize=specialize,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rows"] = [asdict(r) for r in self.rows]
        d["recorded_loads"] = {str(k): v for k, v in self.recorded_loads.items()}
        d["non_attention_clamped"] = list(self.non_attention_clamped)
        d["load_log_loo_residuals"] = list(self.load_log_loo_residuals)
        return d


def _load_rows(records: list[dict]) -> list[ABRow]:
    rows = []
    for rec in records:
        if rec["kind"] != "prefill_ab":
            continue
        workload = rec["parameters"]["workload"]
        for r in rec["results"]["rows"]:
            rows.append(
                ABRow(
                    rec["_file"],
                    r["family"],
                    workload["prompt_tokens_approx"],
                    workload["chunk"],
                    r["gpu_seconds"],
                    r["ane_seconds"],
                    r["ratio"],
                )
            )
    return rows


def _by_file(records: list[dict], name: str) -> dict:
    for rec in records:
        if rec["_file"] == name:
            return rec
    raise AnelabInputError(f"recorded data {name} is missing from the data folder; restore data/{name}")


@dataclass(frozen=True)
class _RowTerms:
    """Score entries, variants and loads of one recorded row under its family's geometry."""

    gpu_entries: float
    ane_entries: float
    variants: int
    visited_arena_bytes: float  # every (layer, history) function the row's ANE arm runs
    fixed_setup: float  # seconds of loads in the row's ANE arm (reloads, plus specialization if paid)
    pays_specialization: bool


def _row_terms(row: ABRow, fit_load: LoadModel, protocol: str = DEFAULT_PROTOCOL) -> _RowTerms:
    """A row's terms; ``fit_load`` prices its loads (specialization included or not, by ``protocol`` and
    whether the cache holds the row's visited arenas, ``planner.loads.pays_specialization``)."""
    g = FAMILIES[row.family].geometry
    chunks = [c for c in chunk_schedule(row.prompt_tokens, row.chunk) if c.device == "ane"]
    n_fa = len(g.full_attention_layers)
    gpu = sum(gpu_score_entries(g, c.tokens, c.history) for c in chunks) * n_fa
    ane = sum(ane_score_entries(g, row.chunk, c.history) for c in chunks) * n_fa
    arena = float(sum(g.score_arena_bytes(row.chunk, c.history) for c in chunks) * n_fa)
    pays, _ = pays_specialization(protocol, arena)
    load = replace(fit_load, specialize=pays, floor_seconds=fit_load.floor_seconds if pays else None)
    fixed = n_fa * sum(load.seconds(g, row.chunk, c.history)[0] for c in chunks)
    return _RowTerms(float(gpu), float(ane), len(chunks) * n_fa, arena, float(fixed), pays)


def _wls(columns: list[np.ndarray], y: np.ndarray, w: np.ndarray) -> np.ndarray:
    a = np.stack(columns, axis=1) * w[:, None]
    return np.linalg.lstsq(a, y * w, rcond=None)[0]


NOTE_FAMILY = "agentworld-35b-a3b-4bit"  # the model TinyTitan's record describes (its reload and specialization)
SPARSE_MODEL = "qwen3.8-125b-a6b"


def _load_records(records: list[dict], held_out: str | None):
    """(points, totals, reload per GB, its basis, Qwen 3.8's cold loads, their chunk and heads) of every load
    record not of the ``held_out`` model: single cold loads less their reload, and the note's total."""
    loads = _by_file(records, "seed-38-variant-loads.json")
    chunk_l, heads_l = loads["parameters"]["chunk"], loads["parameters"]["heads"]
    by_history = {int(x["history"]): float(x["seconds"]) for x in loads["results"]["loads"]}
    note = FAMILIES[NOTE_FAMILY].geometry
    reload_gb = RELOAD_NOTE_SECONDS / (reload_anchor_bytes(note.num_heads) / GB)
    basis = f"~{RELOAD_NOTE_SECONDS} s per layer-chunk at the 35B's mean visited arena ({TINYTITAN_NOTE})"
    if held_out == SPARSE_MODEL:
        by_history = {}
    points = [(score_arena_bytes(heads_l, chunk_l, h), s - reload_gb * score_arena_bytes(heads_l, chunk_l, h) / GB)
              for h, s in by_history.items()]  # fmt: skip
    if held_out != SPARSE_MODEL:
        comp = _by_file(records, "seed-38-package-composition-loads.json")
        h0 = score_arena_bytes(heads_l, chunk_l, 0)
        points += [(h0, float(x["seconds"]) - reload_gb * h0 / GB) for x in comp["results"]["loads"]]
    totals = []
    if held_out != FAMILIES[NOTE_FAMILY].model:
        totals.append((note_arenas(note.num_heads, len(note.full_attention_layers)), SPECIALIZATION_NOTE_SECONDS))
    return points, totals, reload_gb, basis, by_history, chunk_l, heads_l


def _fit(records: list[dict], exclude_ane: tuple[str, str] | None = None, held_out: str | None = None) -> CostFit:
    """Fit the cost model. ``exclude_ane`` = (record, family) holds one row's ANE time out; ``held_out``
    (a model, e.g. "qwen3.5-2b") holds out its A/B rows and its load records (the backtest).

    Loads first (arena only): reload from TinyTitan's note, specialization by ``fit_specialization``
    on every cold load. Then the GPU rates: per row ``gpu - ane = g * gpu_entries - a * ane_entries -
    loads`` (non-attention cancels), weighted by 1/ane (~ ratio error); ``a`` is the recorded h0
    prediction. Without sparse rows the sparse rate is the dense one (assumed)."""
    points, totals, reload_gb, reload_basis, by_history, chunk_l, heads_l = _load_records(records, held_out)
    coef, exp = fit_specialization(points, totals)
    floor = float(min(r["load_seconds"] for r in _by_file(records, "ane-gather-probe.json")["results"]["rows"]))
    base_load = LoadModel(by_history, chunk_l, heads_l, power_coef=coef, power_exp=exp, source=RECORDED,
                          recorded_head_dim=FAMILIES["qwen3.8-125b-a6b-4bit"].geometry.head_dim,
                          floor_seconds=floor, reload_seconds_per_byte=reload_gb / GB)  # fmt: skip

    h0 = _by_file(records, "seed-38-h0-ane-vs-cpu.json")
    p = h0["parameters"]
    ane_rate = h0["results"]["ane_seconds"] / (p["heads"] * p["chunk"] * (p["history"] + p["chunk"]))

    rows = _load_rows(records)
    seen = [r for r in rows if held_out is None or FAMILIES[r.family].model != held_out]
    paired = [r for r in seen if r.ane_seconds is not None and (r.record, r.family) != exclude_ane]
    terms = {(r.record, r.family): _row_terms(r, base_load) for r in rows}

    def rate(kind_rows):
        t = [terms[(r.record, r.family)] for r in kind_rows]
        y = np.array([r.gpu_seconds - r.ane_seconds + ane_rate * x.ane_entries + x.fixed_setup
                      for r, x in zip(kind_rows, t)])  # fmt: skip
        w = np.array([1.0 / r.ane_seconds for r in kind_rows])
        return float(_wls([np.array([x.gpu_entries for x in t])], y, w)[0])

    dense = [r for r in paired if not FAMILIES[r.family].sparse]
    if not dense:
        raise AnelabInputError("no dense A/B rows to fit; restore data/v5.5-ane-matrix-3.json")
    g_dense = rate(dense)
    sparse = [r for r in paired if FAMILIES[r.family].sparse]
    g_sparse = rate(sparse) if sparse else g_dense

    non_attention, clamped = {}, []
    for name, family in FAMILIES.items():
        gpu_rate = g_sparse if family.sparse else g_dense
        residuals = []
        for r in seen:
            if r.family != name or (r.prompt_tokens, r.chunk) != (REFERENCE_TOKENS, REFERENCE_CHUNK):
                continue
            x = terms[(r.record, r.family)]
            residuals.append(r.gpu_seconds - gpu_rate * x.gpu_entries)
            if r.ane_seconds is not None and (r.record, r.family) != exclude_ane:
                residuals.append(r.ane_seconds - ane_rate * x.ane_entries - x.fixed_setup)
        if residuals:
            n = float(np.mean(residuals))
            if n < 0:
                clamped.append(name)
                n = 0.0
            non_attention[name] = n
    return CostFit(
        float(ane_rate), g_dense, g_sparse, coef, exp, by_history, chunk_l, heads_l,
        FAMILIES["qwen3.8-125b-a6b-4bit"].geometry.head_dim, floor, _loo_specialization(points, totals),
        non_attention, tuple(clamped), tuple(rows), reload_gb, reload_basis, held_out,
    )  # fmt: skip


def _loo_specialization(points, totals) -> tuple[float, ...]:
    """ln(recorded / predicted) of each load record, by the specialization law fitted on the others."""
    out = []
    for i in range(len(points) + len(totals)):
        p = [x for j, x in enumerate(points) if j != i]
        t = [x for j, x in enumerate(totals) if j + len(points) != i]
        if not p and not t:
            continue
        coef, exp = fit_specialization(p, t)
        if i < len(points):
            arena, seconds = points[i]
            out.append(float(np.log(seconds / (coef * (arena / GB) ** exp))))
        else:
            arenas, seconds = totals[i - len(points)]
            out.append(float(np.log(seconds / (coef * np.sum((np.asarray(arenas, dtype=float) / GB) ** exp)))))
    return tuple(out)


@functools.lru_cache(maxsize=8)
def cached_fit(data_dir: str, exclude_ane: tuple[str, str] | None, held_out: str | None = None) -> CostFit:
    directory = Path(data_dir)
    if not directory.is_dir():
        raise AnelabInputError(f"recorded data folder {directory} not found; run from the repository or pass data_dir")
    return _fit(read_records(directory), exclude_ane, held_out)


def fit_costs(data_dir: str | Path | None = None) -> CostFit:
    """The cost model fitted on every record in ``data_dir`` (default: the repository's ``data/``)."""
    return cached_fit(str(Path(data_dir or DATA_DIR).resolve()), None)


def _recorded_load_points(fit: CostFit) -> tuple[np.ndarray, np.ndarray]:
    """Qwen 3.8's recorded variant loads: score arena (bytes) and seconds, per recorded history."""
    g = FAMILIES["qwen3.8-125b-a6b-4bit"].geometry
    arenas = np.array([g.score_arena_bytes(REFERENCE_CHUNK, h) for h in fit.recorded_loads], dtype=float)
    return arenas, np.array(list(fit.recorded_loads.values()))


def linear_load_fit(data_dir: str | Path | None = None) -> tuple[float, float]:
    """(slope s/GB, intercept s) of a straight line through the recorded loads against score arena
    (the alternative the power law is judged against)."""
    arenas, seconds = _recorded_load_points(fit_costs(data_dir))
    slope, intercept = np.polyfit(arenas / GB, seconds, 1)
    return float(slope), float(intercept)


def load_fit_report(data_dir: str | Path | None = None) -> list[dict]:
    """Qwen 3.8's recorded loads against the power-law and a linear fit in score-arena bytes."""
    fit = fit_costs(data_dir)
    arenas, seconds = _recorded_load_points(fit)
    slope, intercept = linear_load_fit(data_dir)
    return [
        {
            "history": h,
            "score_arena_gb": float(a / GB),
            "recorded_seconds": float(s),
            "power_fit_seconds": float(
                fit.load_power_coef * (a / GB) ** fit.load_power_exp + fit.reload_seconds_per_gb * a / GB
            ),  # specialization + reload
            "linear_fit_seconds": float(intercept + slope * a / GB),
        }
        for h, a, s in zip(fit.recorded_loads, arenas, seconds)
    ]


# ---- how well the fit recovers the records ----------------------------------------------------
def timed_ab_rows(data_dir: str | Path | None = None) -> tuple[str, CostFit, list[ABRow]]:
    """(the resolved data folder, the fit on every record, the recorded A/B rows with both arms timed): what the
    backtest, the envelope's leave-one-out and the fit report each predict again."""
    directory = str(Path(data_dir or DATA_DIR).resolve())
    fit = cached_fit(directory, None)
    return directory, fit, [row for row in fit.rows if row.ane_seconds is not None]


def ratio_under(row: ABRow, fit: CostFit) -> float:
    """A recorded row's GPU seconds over the ANE seconds ``fit`` predicts for it (:func:`predicted_ane_seconds`)."""
    return row.gpu_seconds / predicted_ane_seconds(row, fit)[0]


def predicted_ane_seconds(row: ABRow, fit: CostFit) -> tuple[float, bool]:
    """ANE-arm seconds for a recorded row given its measured GPU seconds; True if non-attention clamped."""
    family = FAMILIES[row.family]
    x = _row_terms(row, fit.recorded_load_model(specialize=True))
    gpu_rate = fit.gpu_sparse_seconds_per_entry if family.sparse else fit.gpu_dense_seconds_per_entry
    setup = x.fixed_setup
    n = row.gpu_seconds - gpu_rate * x.gpu_entries
    return max(n, 0.0) + fit.ane_seconds_per_entry * x.ane_entries + setup, n < 0
