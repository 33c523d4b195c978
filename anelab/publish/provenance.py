"""Provenance text for figures drawn from records and the planner."""

from __future__ import annotations

from collections.abc import Sequence

from anelab.core.errors import AnelabInputError
from anelab.core.records import machine_kind

PLANNER_NOTE = "lines: planner (anelab.planner) fitted on these records"


SOURCE_LINE_CHARS = 64  # wrap a label's source list past this many characters


def compact_provenance(records: Sequence[dict], *, planner: bool = False) -> str:
    """A figure label short enough for one panel: one line per machine, one listing the sources.

    ``recorded on <model> (<chip>), <os> — replayed, not measured here`` (or ``measured here: <kind>``;
    ``anelab.core.records.machine_kind``),
    then ``source: a.json, b.json`` (the recorded ones: a fresh record is written by the same run); with
    ``planner`` a last line says the lines are the planner's.
    The full per-record text (``anelab.publish.figures.provenance_text``) belongs in the manifest.
    """
    if not records:
        raise AnelabInputError("compact_provenance needs at least one record")
    machines, sources = [], []
    for r in records:
        machine = machine_kind(r.get("provenance") or {})
        if r.get("origin") == "recorded":
            line = f"recorded on {machine} — replayed, not measured here"
        elif r.get("origin") == "measured":
            line = f"measured here: {machine}"
        else:
            raise AnelabInputError(
                f"record {r.get('_file', '?')} has origin {r.get('origin')!r}; expected measured or recorded"
            )
        if line not in machines:
            machines.append(line)
        name = r.get("_file") or (r.get("source") or {}).get("record")
        if r.get("origin") == "recorded" and name not in sources:  # a fresh record is this run's own
            sources.append(name or "unnamed record")
    if not sources:
        return "\n".join(machines + ([PLANNER_NOTE] if planner else []))
    lines = [f"source: {sources[0]}"]
    for name in sources[1:]:  # wrap the source list at SOURCE_LINE_CHARS
        if len(lines[-1]) + 2 + len(name) > SOURCE_LINE_CHARS:
            lines[-1] += ","
            lines.append(name)
        else:
            lines[-1] += f", {name}"
    return "\n".join(machines + lines + ([PLANNER_NOTE] if planner else []))
