"""Each study's headline numbers, declared once (``HEADLINES``) and read from the records a run writes.

A headline names the record kind it reads and a function of the run's records of that kind; a
run that wrote no such record (e.g. a Mac-only timing on Linux) has no value for it (None), which
the batch summary shows as "—". ``SUMMARY_PLOTS`` names, per study, the parameter and headline of
the one figure a batch draws across its grid (where a figure says more than the table).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from anelab.records import read_records
from anelab.sidecar.designs import DENSE, STATEFUL, TILED


@dataclass(frozen=True)
class Headline:
    """One number of a study's run: ``value(records of kind) -> float | None``."""

    name: str  # column name in the summary table
    label: str  # what it is, in the study's words
    unit: str
    kind: str  # record kind it is read from
    value: Callable[[list[dict]], float | None]


def _widest(records: list[dict]) -> dict | None:
    """The widest chunk's entry of the last ``mask_fold`` record (the notebook's headline width)."""
    if not records:
        return None
    widths = records[-1]["results"]["widths"]
    return widths[max(widths, key=int)]


def _probe_ratio(field: str) -> Callable[[list[dict]], float | None]:
    """gather / full-scores of ``field`` at the first probe chunk of the last ``gather_probe_numpy`` record
    (a record from before the rename calls the full-scores probe "dense": ``gather_probe.probe_graph_name``)."""
    from anelab.studies.gather_probe import FULL_SCORES, GATHER, probe_graph_name

    def value(records: list[dict]) -> float | None:
        if not records:
            return None
        rows = records[-1]["results"]["rows"]
        chunk = rows[0]["chunk"]
        by_graph = {probe_graph_name(r["graph"]): r[field] for r in rows if r["chunk"] == chunk}
        if not by_graph.get(FULL_SCORES) or GATHER not in by_graph:
            return None
        return by_graph[GATHER] / by_graph[FULL_SCORES]

    return value


def _package_rows(records: list[dict]) -> list[dict]:
    return records[-1]["results"]["rows"] if records else []


def _program_bytes_per_function(records: list[dict]) -> float | None:
    rows = _package_rows(records)
    if len(rows) < 2:
        return None
    first, last = rows[0], rows[-1]
    return (last["spec_bytes"] - first["spec_bytes"]) / (last["functions"] - first["functions"])


def _cold_setup_seconds(records: list[dict]) -> float | None:
    """Sum of the median cold loads, one per function: the setup of visiting every function once."""
    cold = {r["parameters"]["function"]: r["results"]["median_s"] for r in records if r["parameters"].get("cold")}
    return sum(cold.values()) if cold else None


def _largest_intermediate(design: str) -> Callable[[list[dict]], float | None]:
    def value(records: list[dict]) -> float | None:
        if not records:
            return None
        package = records[-1]["results"]["packages"].get(design)
        return float(max(package["largest_intermediate_bytes"].values())) if package else None

    return value


def _worst_graph_error(records: list[dict]) -> float | None:
    rows = records[-1]["results"]["verification"] if records else []
    return max((r["graph_error"] for r in rows), default=None)


def _ane_over_gpu_at_largest_history(records: list[dict]) -> float | None:
    from anelab.studies.dense_offload import ab_table

    rows = [r for r in ab_table(records) if r["ane_over_gpu"] is not None] if records else []
    return rows[-1]["ane_over_gpu"] if rows else None


HEADLINES: dict[str, tuple[Headline, ...]] = {
    "01_dense_offload": (
        Headline(
            "gpu_over_ane",
            "GPU / Neural Engine predict time at the largest history (Mac only)",
            "x",
            "predict_timing",
            _ane_over_gpu_at_largest_history,
        ),
    ),
    "02_mask_fold": (
        Headline("fold_error", "fold error: saved graph vs fp64 reference, widest chunk", "relative", "mask_fold",
                 lambda rs: (w := _widest(rs)) and w["check"]["fold_error"]),
        Headline("causal_off", "causal-only mask against the same reference", "relative", "mask_fold",
                 lambda rs: (w := _widest(rs)) and w["check"]["causal_off"]),
        Headline("causal_off_over_noise", "causal-off x the fp16 noise floor", "x", "mask_fold",
                 lambda rs: (w := _widest(rs)) and w["check"]["noise_ratio"]),
        Headline("control_error", "negative control (random selection) error", "relative", "mask_fold",
                 lambda rs: (w := _widest(rs)) and w["control"]["fold_error"]),
    ),
    "03_gather_sizing": (
        Headline("gather_over_dense_intermediate", "gather / dense largest intermediate, first probe chunk", "x",
                 "gather_probe_numpy", _probe_ratio("largest_intermediate_bytes")),
        Headline("gather_over_dense_numpy_s", "gather / dense NumPy evaluation time (CPU, not the ANE)", "x",
                 "gather_probe_numpy", _probe_ratio("numpy_eval_median_s")),
    ),
    "04_setup_cost": (
        Headline("setup_seconds", "sum of median cold loads over the functions (Mac only)", "s", "load_timing",
                 _cold_setup_seconds),
        Headline("weight_bytes", "weight.bin bytes (stored once)", "B", "package_size",
                 lambda rs: float(_package_rows(rs)[-1]["weight_bytes"]) if rs else None),
        Headline("program_bytes_per_function", "model.mlmodel growth per added function", "B", "package_size",
                 _program_bytes_per_function),
    ),
    "05_tiled_stateful": (
        Headline("largest_intermediate_dense", "largest intermediate, dense design", "B", "design_comparison",
                 _largest_intermediate(DENSE)),
        Headline("largest_intermediate_tiled", "largest intermediate, tiled design", "B", "design_comparison",
                 _largest_intermediate(TILED)),
        Headline("largest_intermediate_stateful", "largest intermediate, stateful design", "B", "design_comparison",
                 _largest_intermediate(STATEFUL)),
        Headline("worst_graph_error", "worst graph error over designs and weight modes", "relative",
                 "design_comparison", _worst_graph_error),
    ),
}  # fmt: skip


SUMMARY_PLOTS: dict[str, tuple[str, str]] = {  # study -> (grid parameter on x, headline on y)
    "02_mask_fold": ("compress_ratio", "fold_error"),
    "03_gather_sizing": ("head_dim", "gather_over_dense_intermediate"),
    "04_setup_cost": ("export_chunk", "program_bytes_per_function"),
    "05_tiled_stateful": ("export_chunk", "largest_intermediate_dense"),
}


def headlines_for(study: str) -> tuple[Headline, ...]:
    """The declared headlines of a study (by notebook stem); none for a study that declares none."""
    return HEADLINES.get(study, ())


def headline_values(study: str, records: list[dict]) -> dict[str, float | None]:
    """{headline name: value} from a run's records (all kinds; each headline picks its own)."""
    out = {}
    for h in headlines_for(study):
        value = h.value([r for r in records if r["kind"] == h.kind])
        out[h.name] = None if value is None else float(value)
    return out


def run_headlines(study: str, run_dir: str | os.PathLike) -> dict[str, float | None]:
    """Headline values of one run directory (from ``<run>/records``)."""
    records_dir = Path(run_dir) / "records"
    records = read_records(records_dir) if records_dir.is_dir() else []
    return headline_values(study, records)
