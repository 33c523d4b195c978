"""Fresh Mac data for the studies: the records ``anelab measure`` left in ``data/measured/``, labelled.

A figure that draws them says "measured on <chip>, <OS>" beside the seeds' replay, and its manifest
provenance starts with ``FRESH_MARK`` so ``make reproduce`` can list the figures that used fresh data.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from anelab.core.paths import MEASURED_DIR
from anelab.core.records import read_records
from anelab.publish.figures import provenance_text, read_manifest

FRESH_MARK = "fresh data: "


@dataclass(frozen=True)
class FreshData:
    """Mac records of one kind from one machine (chip, OS), newest machine first."""

    label: str  # "measured on <chip>, <OS>"
    records: list[dict]

    def provenance_note(self) -> str:
        """A figure's manifest provenance for these records (marked fresh)."""
        return FRESH_MARK + self.label + "\n" + provenance_text(self.records)


def fresh_data(
    kind: str, records_dir: str | os.PathLike = MEASURED_DIR, *, step: str | None = None
) -> FreshData | None:
    """The newest Mac machine's measured records of ``kind`` (and ``anelab measure`` step), or None.

    Only records of origin ``measured`` whose provenance says macOS count: the seeds' replay is in
    ``data/`` and Linux runs measure nothing on Core ML.
    """
    if not Path(records_dir).is_dir():
        return None
    groups: dict[tuple[str, str], list[dict]] = {}
    for rec in read_records(records_dir, kind=kind):
        prov = rec.get("provenance", {})
        if rec.get("origin") != "measured" or not str(prov.get("os_version", "")).startswith("macOS"):
            continue
        if step is not None and rec.get("parameters", {}).get("measure", {}).get("step") != step:
            continue
        groups.setdefault((str(prov.get("chip", "unknown")), str(prov["os_version"])), []).append(rec)
    if not groups:
        return None
    (chip, os_version), records = max(
        groups.items(), key=lambda kv: max(r["provenance"].get("date", "") for r in kv[1])
    )
    return FreshData(f"measured on {chip}, {os_version}", _newest_per_measurement(records))


def _newest_per_measurement(records: list[dict]) -> list[dict]:
    """One record per measurement (same parameters, ``measure`` tag aside): the newest (``--again`` re-runs)."""
    newest: dict[str, dict] = {}
    for rec in sorted(records, key=lambda r: (r["provenance"].get("date", ""), r.get("_file", ""))):
        params = {k: v for k, v in rec.get("parameters", {}).items() if k != "measure"}
        newest[json.dumps(params, sort_keys=True, default=str)] = rec
    return list(newest.values())


def figures_with_fresh_data(figures_dir: str | os.PathLike) -> list[str]:
    """Names of the figures in ``figures_dir``'s manifest that were drawn from fresh Mac data."""
    manifest = read_manifest(figures_dir)
    return [
        name for name, e in manifest.get("figures", {}).items() if str(e.get("provenance", "")).startswith(FRESH_MARK)
    ]
