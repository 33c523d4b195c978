"""Provenance text for figures drawn from records and the planner."""

from __future__ import annotations

from collections.abc import Sequence

from anelab.errors import AnelabInputError
from anelab.studies.planner.plan import PrefillPlan

PLANNER_NOTE = "lines: planner (anelab.plan) fitted on these records"


SOURCE_LINE_CHARS = 64  # wrap a label's source list past this many characters


def compact_provenance(records: Sequence[dict], *, planner: bool = False) -> str:
    """A figure label short enough for one panel: one line per machine, one listing the sources.

    ``recorded on <model> (<chip>), <os> — replayed, not measured here`` (or ``measured here: ...``),
    then ``source: a.json, b.json``; with ``planner`` a last line says the lines are the planner's.
    The full per-record text (``anelab.figures.provenance_text``) belongs in the manifest.
    """
    if not records:
        raise AnelabInputError("compact_provenance needs at least one record")
    machines, sources = [], []
    for r in records:
        prov = r.get("provenance") or {}
        chip = str(prov.get("chip", "unknown")).removeprefix("Apple ")
        machine = f"{prov.get('machine_model', 'unknown')} ({chip}), {prov.get('os_version', 'unknown')}"
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
        name = r.get("_file") or (r.get("source") or {}).get("record") or "unnamed record"
        if name not in sources:
            sources.append(name)
    lines = [f"source: {sources[0]}"]
    for name in sources[1:]:  # wrap the source list at SOURCE_LINE_CHARS
        if len(lines[-1]) + 2 + len(name) > SOURCE_LINE_CHARS:
            lines[-1] += ","
            lines.append(name)
        else:
            lines[-1] += f", {name}"
    return "\n".join(machines + lines + ([PLANNER_NOTE] if planner else []))


def describe_plan(p: PrefillPlan) -> str:
    """A short text of a plan for the notebooks' interactive control."""
    head = f"{p.family or 'custom geometry'}: {p.prompt_tokens:,} tokens, chunk {p.chunk:,}"
    return "\n".join(
        [
            head,
            f"  decision: {p.decision} (predicted ratio {p.predicted_ratio:.2f}x) — {p.reason}",
            f"  GPU arm {p.gpu_prefill_seconds:.1f} s; ANE arm {p.ane_prefill_seconds:.1f} s "
            f"= non-attention {p.non_attention_seconds:.1f} + ANE attention {p.ane_attention_seconds:.1f} "
            f"+ setup {p.setup_seconds:.1f} ({p.variants_visited} variant loads)"
            + ("" if p.fits else f"; past coverage {p.coverage:,}"),
        ]
    )
