"""A study's headline numbers: ``Headline`` and the functions that read one from a run's records.

A headline names the record kind it reads and a function of the run's records of that kind; a run that wrote
no such record (e.g. a Mac-only timing on Linux) has no value for it (None), which the batch summary shows as
"—". Each study's headlines are declared in its row of ``publish.studies.STUDIES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from anelab.runtimes.coreml.block_ab import ab_table
from anelab.sidecar.graphs.probe_graphs import FULL_SCORES, GATHER, probe_graph_name


@dataclass(frozen=True)
class Headline:
    """One number of a study's run: ``value(records of kind) -> float | None``."""

    name: str  # column name in the summary table
    label: str  # what it is, in the study's words
    unit: str
    kind: str  # record kind it is read from
    value: Callable[[list[dict]], float | None]


def widest(records: list[dict]) -> dict | None:
    """The widest chunk's entry of the last ``mask_fold`` record (the notebook's headline width)."""
    if not records:
        return None
    widths = records[-1]["results"]["widths"]
    return widths[max(widths, key=int)]


def probe_ratio(field: str) -> Callable[[list[dict]], float | None]:
    """gather / full-scores of ``field`` at the first probe chunk of the last ``gather_probe_numpy`` record
    (a record from before the rename calls the full-scores probe "dense": ``sidecar.graphs.probe_graphs.probe_graph_name``)."""

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


def package_rows(records: list[dict]) -> list[dict]:
    return records[-1]["results"]["rows"] if records else []


def program_bytes_per_function(records: list[dict]) -> float | None:
    rows = package_rows(records)
    if len(rows) < 2:
        return None
    first, last = rows[0], rows[-1]
    return (last["spec_bytes"] - first["spec_bytes"]) / (last["functions"] - first["functions"])


def cold_setup_seconds(records: list[dict]) -> float | None:
    """Sum of the median cold loads, one per function: the setup of visiting every function once."""
    cold = {r["parameters"]["function"]: r["results"]["median_s"] for r in records if r["parameters"].get("cold")}
    return sum(cold.values()) if cold else None


def largest_intermediate(design: str) -> Callable[[list[dict]], float | None]:
    def value(records: list[dict]) -> float | None:
        if not records:
            return None
        package = records[-1]["results"]["packages"].get(design)
        return float(max(package["largest_intermediate_bytes"].values())) if package else None

    return value


def worst_graph_error(records: list[dict]) -> float | None:
    rows = records[-1]["results"]["verification"] if records else []
    return max((r["graph_error"] for r in rows), default=None)


def ane_over_gpu_at_largest_history(records: list[dict]) -> float | None:
    """Notebook 01's A/B ratio (``anelab.runtimes.coreml.block_ab.ab_table``: Core ML's own predict durations, as ``anelab
    decide`` reads them) at the largest history both arms ran."""

    rows = [r for r in ab_table(records) if r["ane_over_gpu"] is not None] if records else []
    return rows[-1]["ane_over_gpu"] if rows else None
