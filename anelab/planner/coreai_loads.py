"""Core AI's setup priced from ``anelab measure``'s records.

``anelab measure`` times one layer both ways on one Mac: Core ML's cold loads of its functions h<H>
(``load_timing``) and Core AI's asset of the same functions (``coreai_specialization``: one
specialization of the whole asset, then ``load_function`` per entrypoint), tagged with the same Core ML
package. Their ratio on that layer and Mac, per Core AI mode (cold: first specialization; fresh_process:
the cached entry in a new process, what every later launch pays; compiled_cold: the AOT ``.aimodelc``),

    r = (S + sum_h f_h) / sum_h L_h      S: the asset's load in that mode, f_h: load_function of h<H>,
                                         L_h: Core ML's cold load of h<H> (all on the same layer and Mac)

prices a family's variants at r x its Core ML load (the planner's one load model): a Core AI load is
then ``extrapolated`` (a ratio measured on another geometry applied to the family's loads), never recorded.

What a record must beat (the load that flips a verdict) is ``planner.load_flip``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.core.paths import MEASURED_DIR
from anelab.core.records import read_records
from anelab.planner.catalogue import EXTRAPOLATED
from anelab.planner.fit import LoadModel
from anelab.sidecar.backends import COREAI, get_backend

MODES = ("cold", "fresh_process", "compiled_cold")
PRICED_MODE = "fresh_process"  # the cached entry: what a prompt pays once the asset was specialized once
MISSING = "no Core AI record: run 'anelab measure' on macOS 27 (it times Core AI beside Core ML on the same layer)"


@dataclass(frozen=True)
class CoreAIRatio:
    """One Core AI mode against Core ML's cold loads of the same layer on the same Mac."""

    mode: str
    ratio: float
    coreai_seconds: float  # S + sum of load_function
    coreml_seconds: float  # sum of Core ML's cold loads
    functions: tuple[str, ...]
    machine: str
    coreml_package_sha256: str


def _machine(record: dict) -> str:
    p = record["provenance"]
    return f"{p.get('chip', 'unknown')}, {p.get('os_version', 'unknown')}"


def coreai_ratios(records_dir: str | Path = MEASURED_DIR) -> dict[str, CoreAIRatio]:
    """mode -> ratio, from the newest Core AI records whose Core ML package also has cold loads recorded (Mac
    measurements only: a record whose provenance is not macOS prices nothing)."""
    if not Path(records_dir).is_dir():
        return {}
    records = [
        r
        for r in read_records(records_dir)
        if r.get("origin") == "measured" and str(r["provenance"].get("os_version", "")).startswith("macOS")
    ]
    coreml = {}  # package hash -> function -> cold median
    for r in records:
        if r["kind"] == "load_timing" and r["parameters"].get("cold"):
            key = r["parameters"].get("measure", {}).get("package_sha256")
            coreml.setdefault(key, {})[r["parameters"]["function"]] = r["results"]["median_s"]
    layer = [r for r in records if r["kind"] == "coreai_specialization" and "sweep" not in r["parameters"]]
    out: dict[str, CoreAIRatio] = {}
    for r in sorted(layer, key=lambda r: r["provenance"].get("date", "")):  # the newest wins
        p, key = r["parameters"], r["parameters"].get("coreml_package_sha256")
        names, loads = tuple(p["entrypoint_names"]), coreml.get(key, {})
        if p["mode"] not in MODES or not names or any(n not in loads for n in names):
            continue
        coreai = r["results"]["median_s"] + sum(r["results"]["load_function_s"].get(n, 0.0) for n in names)
        coreml_total = sum(loads[n] for n in names)
        out[p["mode"]] = CoreAIRatio(p["mode"], coreai / coreml_total, coreai, coreml_total, names, _machine(r), key)
    return out


@dataclass(frozen=True)
class CoreAILoadModel(LoadModel):
    """``base``'s loads scaled by a measured Core AI / Core ML ratio; every price is ``extrapolated``."""

    base: LoadModel | None = None
    ratio: CoreAIRatio | None = None

    def _label(self, source: str) -> str:
        r = self.ratio
        return (f"{EXTRAPOLATED} (Core AI {r.mode}: {r.ratio:.3g}x Core ML's loads, measured on {r.machine} for "
                f"{len(r.functions)} functions of one layer; applied to: {source})")  # fmt: skip

    def seconds(self, geometry, chunk: int, history: int) -> tuple[float, str]:
        seconds, source = self.base.seconds(geometry, chunk, history)
        return seconds * self.ratio.ratio, self._label(source)

    def at_arena(self, num_heads: int, head_dim: int | None, chunk: int, arena_bytes: int) -> tuple[float, str]:
        seconds, source = self.base.at_arena(num_heads, head_dim, chunk, arena_bytes)
        return seconds * self.ratio.ratio, self._label(source)


def coreai_load_model(base: LoadModel, records_dir: str | Path = MEASURED_DIR, mode: str = PRICED_MODE) -> LoadModel:
    """The family's load model priced for a Core AI sidecar (refused in one line without a record)."""
    ratios = coreai_ratios(records_dir)
    if mode not in ratios:
        raise AnelabInputError(f"{MISSING}; {mode} not recorded in {records_dir}")
    return CoreAILoadModel(**{**base.__dict__, "base": base, "ratio": ratios[mode], "source": EXTRAPOLATED})


class PricedFit:
    """A ``CostFit`` whose loads are priced for a sidecar format (``backend``) from ``records_dir``; every
    other attribute is the fit's own."""

    def __init__(self, fit, backend: str, records_dir: Path):
        self.fit, self.backend, self.records_dir = fit, backend, records_dir

    def __getattr__(self, name):
        return getattr(self.fit, name)


def priced_fit(fit, backend: str | None, data_dir=None):
    """``fit`` as it is for Core ML's loads (``backend`` None or coreml); for Core AI a ``PricedFit`` reading
    the records ``anelab measure`` wrote (``data_dir``/measured, default ``MEASURED_DIR``). Refuses an unknown
    back-end, or a Core AI one without a record, in one line."""

    if get_backend(backend).name != COREAI:
        return fit
    records = MEASURED_DIR if data_dir is None else Path(data_dir) / "measured"
    coreai_load_model(fit.recorded_load_model(), records)  # refused here, before any plan, without a record
    return PricedFit(fit, COREAI, records)


def price_loads(fit, load: LoadModel, source: str) -> tuple[LoadModel, str]:
    """(load model, its source text): as given, unless ``fit`` is a ``PricedFit`` (Core AI's, from its records)."""
    if not isinstance(fit, PricedFit):
        return load, source
    priced = coreai_load_model(load, fit.records_dir)
    r = priced.ratio
    return priced, f"{EXTRAPOLATED}: Core AI ({r.mode}) at {r.ratio:.3g}x {source} (ratio measured on {r.machine})"
