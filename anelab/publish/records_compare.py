"""Listing every record anelab can see, and fresh values beside the seeds' recorded ones.

Records are gathered from ``data/`` (the seeds' recorded values), ``data/measured/`` and every
run directory's ``records/`` (``runs/<study>/<run id>/records``), or from directories given
explicitly. Each is keyed by its content hash, not its file name, so trees copied together from
several machines merge without collisions (two machines can write the same file name; an
identical record found twice counts once). Each record carries its provenance (machine, chip, OS,
date), which ``--machine`` filters on.

``COMPARISONS`` declares each quantity once: the seed record and value it was recorded as, how a
fresh record of a given kind holds the same quantity (and the workload it was measured on), and,
where anelab can compute it, the predicted value. ``compare`` gives one row per fresh or predicted
value: recorded, fresh, ratio fresh / recorded and difference fresh - recorded, both provenances.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.core.gather_size import GatherSizing
from anelab.core.paths import DATA_DIR, MEASURED_DIR, REPO_ROOT, RUNS_DIR
from anelab.core.records import read_records
from anelab.planner import load_fit_report


def default_sources() -> list[Path]:
    """``data/``, ``data/measured/`` and each ``runs/<study>/<run>/records`` that exists."""
    sources = [DATA_DIR, MEASURED_DIR]
    if RUNS_DIR.is_dir():
        sources += sorted(RUNS_DIR.glob("*/*/records"))
    return [s for s in sources if s.is_dir()]


def _where(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def gather_records(
    sources: list[str | os.PathLike] | None = None, *, skipped: list[tuple[Path, str]] | None = None
) -> list[dict]:
    """Every record in the sources, each with ``_path`` (where it was found) and ``_id`` (content hash);
    an identical record found in several places is kept once. ``skipped``: collect unreadable records
    there (path, reason) and go on (``records list``), instead of refusing them all."""
    seen: dict[str, dict] = {}
    for source in default_sources() if sources is None else [Path(s) for s in sources]:
        if not Path(source).is_dir():
            raise AnelabInputError(f"{source}: no such records directory")
        for record in read_records(source, skipped=skipped):
            body = {k: v for k, v in record.items() if not k.startswith("_")}
            digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
            seen.setdefault(digest, {**record, "_path": _where(Path(source) / record["_file"]), "_id": digest})
    return sorted(seen.values(), key=lambda r: (r["kind"], r["_path"]))


def machine_text(record: dict) -> str:
    """``<model> (<chip>), <os>`` of a record's provenance."""
    prov = record["provenance"]
    return f"{prov['machine_model']} ({prov['chip'].removeprefix('Apple ')}), {prov['os_version']}"


def select(records: list[dict], kind: str | None = None, machine: str | None = None) -> list[dict]:
    """Records of one ``kind`` and/or whose machine text contains ``machine`` (case-insensitive)."""
    out = [r for r in records if kind is None or r["kind"] == kind]
    if machine is not None:
        out = [r for r in out if machine.lower() in machine_text(r).lower()]
    return out


def list_rows(records: list[dict]) -> list[dict]:
    """One row per record for ``anelab records list``."""
    return [
        {
            "kind": r["kind"],
            "origin": r["origin"],
            "machine": machine_text(r),
            "date": r["provenance"]["date"],
            "path": r["_path"],
            "id": r["_id"],
        }
        for r in records
    ]


# ---- the quantities: recorded by the seeds, and how a fresh record or anelab gives them -------------


@dataclass(frozen=True)
class Comparison:
    """One quantity: the seed's recorded value, and where a fresh or predicted value comes from."""

    quantity: str
    unit: str
    recorded_file: str  # a record in data/
    recorded: Callable[[dict], float]
    fresh_kind: str | None = None  # record kind holding the same quantity, measured
    fresh: Callable[[dict], float | None] | None = None
    workload: Callable[[dict], str] | None = None  # the fresh record's workload, in words
    predicted: Callable[[], float] | None = None  # anelab's own value (formula, planner)
    predicted_by: str = ""


def _seed_row(record: dict, prefix: str) -> dict:
    return next(r for r in record["results"]["rows"] if r["check"].startswith(prefix))


def _widest_check(record: dict) -> dict:
    widths = record["results"]["widths"]
    return widths[max(widths, key=int)]


def _fold_workload(record: dict) -> str:
    p, w = record["parameters"], _widest_check(record)["check"]
    return (
        f"{p.get('checkpoint', '?')}, chunk {w['chunk']}, history {w['history']}, "
        f"compress ratio {p.get('compress_ratio', '?')}, seed {p.get('seed', '?')}"
    )


def _seed_gather_sizing():

    return GatherSizing(24, 256, 4096, 8192, 2051)  # the seed's sizing: 24 heads x 256, budget 2,051


def _planner_load(history: int) -> Callable[[], float]:
    def value() -> float:

        return next(r["power_fit_seconds"] for r in load_fit_report(DATA_DIR) if r["history"] == history)

    return value


def _seed_load(history: int) -> Callable[[dict], float]:
    return lambda rec: next(x["seconds"] for x in rec["results"]["loads"] if x["history"] == history)


def _fresh_cold_load(history: int) -> Callable[[dict], float | None]:
    def value(rec: dict) -> float | None:
        p = rec["parameters"]
        return rec["results"].get("median_s") if p.get("cold") and p.get("function") == f"h{history}" else None

    return value


def _load_workload(record: dict) -> str:
    p = record["parameters"]
    return f"{p.get('package', '?')}, {p.get('compute_units', '?')}"


GB = 1e9
FOLD = "seed-qsa-fold-correctness.json"
SIZING = "ane-gather-probe.json"
LOADS = "seed-38-variant-loads.json"

COMPARISONS: tuple[Comparison, ...] = (
    Comparison("fold error: graph vs reference", "%", FOLD,
               lambda r: _seed_row(r, "graph vs NumPy")["relative_error_percent"],
               "mask_fold", lambda r: 100 * _widest_check(r)["check"]["fold_error"], _fold_workload),
    Comparison("causal-only mask off the reference", "%", FOLD,
               lambda r: _seed_row(r, "causal-only")["off_percent"],
               "mask_fold", lambda r: 100 * _widest_check(r)["check"]["causal_off"], _fold_workload),
    Comparison("causal-off over the fp16 noise floor", "x", FOLD,
               lambda r: _seed_row(r, "causal-only")["over_fp16_noise"],
               "mask_fold", lambda r: _widest_check(r)["check"]["noise_ratio"], _fold_workload),
    Comparison("gathered keys at chunk 4,096, budget 2,051", "GB", SIZING,
               lambda r: r["results"]["sizing_at_chunk_4096"]["gathered_keys_gb"],
               predicted=lambda: _seed_gather_sizing().gather_key_bytes / GB,
               predicted_by="anelab.core.gather_size (formula)"),
    Comparison("dense score matrix at chunk 4,096", "GB", SIZING,
               lambda r: r["results"]["sizing_at_chunk_4096"]["dense_score_matrix_gb"],
               predicted=lambda: _seed_gather_sizing().dense_score_bytes / GB,
               predicted_by="anelab.core.gather_size (formula)"),
    Comparison("gathered keys / dense scores", "x", SIZING,
               lambda r: r["results"]["sizing_at_chunk_4096"]["data_factor"],
               predicted=lambda: _seed_gather_sizing().ratio,
               predicted_by="anelab.core.gather_size (formula)"),
    *(
        Comparison(f"setup: cold load of variant h{h}", "s", LOADS, _seed_load(h),
                   "load_timing", _fresh_cold_load(h), _load_workload,
                   predicted=_planner_load(h), predicted_by="planner power law fitted on these loads")
        for h in (0, 4096, 8192)
    ),
)  # fmt: skip


def _row(c: Comparison, recorded: dict, value: float, fresh: float, provenance: str, workload: str) -> dict:
    return {
        "quantity": c.quantity,
        "unit": c.unit,
        "recorded": value,
        "recorded_provenance": f"recorded on {machine_text(recorded)} — {recorded['_path']}",
        "fresh": fresh,
        "fresh_provenance": provenance,
        "ratio": fresh / value if value else None,
        "difference": fresh - value,
        "workload": workload,
    }


def compare(records: list[dict], machine: str | None = None) -> list[dict]:
    """Fresh (measured) and predicted values beside each recorded quantity of ``COMPARISONS``.

    A quantity with a fresh kind but no such record yet gets a row with ``fresh`` None (so the table
    shows what a run would add, e.g. load timings on a Mac). ``machine`` keeps fresh records of that machine.
    """
    by_file = {r["_file"]: r for r in records if r["origin"] == "recorded"}
    fresh = select([r for r in records if r["origin"] == "measured"], machine=machine)
    rows = []
    for c in COMPARISONS:
        if c.recorded_file not in by_file:
            raise AnelabInputError(f"no recorded {c.recorded_file} among the records; include data/ in the sources")
        recorded = by_file[c.recorded_file]
        value = _read_value(c.recorded, recorded, c)
        found = []
        for r in select(fresh, kind=c.fresh_kind) if c.fresh_kind else []:
            v = _read_value(c.fresh, r, c)
            if v is not None:
                where = f"measured on {machine_text(r)} — {r['_path']}"
                workload = _read_value(c.workload, r, c, number=False) if c.workload else ""
                found.append(_row(c, recorded, value, v, where, workload))
        if c.fresh_kind and not found:
            found.append({**_row(c, recorded, value, value, "", ""), "fresh": None, "ratio": None, "difference": None})
            found[-1]["fresh_provenance"] = f"no fresh {c.fresh_kind} record yet"
        if c.predicted is not None:
            predicted = float(c.predicted())
            found.append(_row(c, recorded, value, predicted, f"predicted: {c.predicted_by}", "the seed's workload"))
        rows += found
    return rows


def _read_value(read: Callable[[dict], object], record: dict, c: Comparison, *, number: bool = True):
    """``read(record)`` (a float when ``number``; None passes through): a schema-valid record whose results
    lack the field or hold a value of another type is refused naming its file and the quantity."""
    try:
        value = read(record)
        if value is None or not number:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise TypeError(value)
        return float(value)
    except (KeyError, TypeError, ValueError, IndexError, StopIteration, AttributeError):
        raise AnelabInputError(
            f"{record.get('_path', '?')}: its {record.get('kind')} results do not hold {c.quantity!r} as a number "
            "where anelab reads it; fix or remove the record"
        ) from None


def _number(v) -> str:
    return "—" if v is None else f"{v:.4g}"


def compare_table(rows: list[dict]) -> str:
    """The comparison as aligned text: one line of numbers per row, its provenances indented below."""
    lines = [f"{'quantity':<44} {'unit':>4} {'recorded':>10} {'fresh':>10} {'ratio':>8} {'difference':>11}"]
    for r in rows:
        lines.append(
            f"{r['quantity']:<44} {r['unit']:>4} {_number(r['recorded']):>10} {_number(r['fresh']):>10} "
            f"{_number(r['ratio']):>8} {_number(r['difference']):>11}"
        )
        lines.append(f"    recorded: {r['recorded_provenance']}")
        lines.append(f"    fresh:    {r['fresh_provenance']}" + (f" ({r['workload']})" if r["workload"] else ""))
    return "\n".join(lines)
