"""Figures of the studies: byte-deterministic PNG + SVG, a manifest, and provenance labels.

``save_figure`` writes ``<name>.png`` and ``<name>.svg`` into a figures directory and records each
file's sha256, the notebook and the parameters that made it in ``MANIFEST.json`` beside them. The
bytes depend only on the figure and the pinned matplotlib: the SVG hash salt is fixed (matplotlib
otherwise salts its element ids with a random uuid), no date goes into either file's metadata, and
the dpi is a named constant. Both files and the manifest are written atomically (temp + rename).

Figures drawn from recorded data (a record with ``origin: "recorded"``, e.g. the seed's M3 tables)
say so inside the figure: ``label_recorded(ax, record)`` draws

    recorded on Mac15,3 (M3), macOS 27.0 — source: <record file> — replayed, not measured here

and a fresh measurement is labelled ``measured here: <machine>``. ``provenance_text(records)`` is
the same text for a list of records (what ``save_figure`` stores as the figure's provenance note).

Every figure's caption and alt text are declared once, in ``captions.toml`` beside this module
(``caption_for``), with the provenance kinds it draws (``PROVENANCE_KINDS``: measured here,
recorded elsewhere, predicted); ``save_figure`` copies them into the manifest entry, and
``annotate_manifest`` adds them to an existing manifest without redrawing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import tomllib
from functools import cache
from pathlib import Path

from anelab import __version__
from anelab.errors import AnelabInputError
from anelab.records import atomic_write_bytes, atomic_write_text, machine_description

DPI = 120


SVG_HASH_SALT = "anelab"


MANIFEST = "MANIFEST.json"


FORMATS = ("png", "svg")


# Drawing style shared by every study figure. DejaVu Sans ships with matplotlib, so glyph outlines
# (SVG text is drawn as paths) do not depend on the fonts installed on the machine.
STYLE = {
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "figure.dpi": DPI,
    "savefig.dpi": DPI,
    "svg.hashsalt": SVG_HASH_SALT,
    "svg.fonttype": "path",
    "path.simplify": True,
    "figure.constrained_layout.use": True,
}


LABEL_PLACES = {  # loc -> (x, y, ha, va) in axes coordinates
    "lower left": (0.01, 0.02, "left", "bottom"),
    "lower right": (0.99, 0.02, "right", "bottom"),
    "upper left": (0.01, 0.98, "left", "top"),
    "upper right": (0.99, 0.98, "right", "top"),
}


CAPTIONS_FILE = Path(__file__).with_name("captions.toml")


PROVENANCE_KINDS = ("measured here", "recorded elsewhere", "predicted")


RECORDED_COLOUR = "#8a4b00"


MEASURED_COLOUR = "#1f4e79"


def use_style() -> None:
    """Apply ``STYLE`` to matplotlib's rcParams (notebooks call this once, before drawing)."""
    import matplotlib as mpl

    mpl.rcParams.update(STYLE)


def _metadata(fmt: str) -> dict:
    """Per-format savefig metadata with no date (SVG would otherwise carry the save time)."""
    import matplotlib as mpl

    creator = f"anelab {__version__} (matplotlib {mpl.__version__})"
    if fmt == "svg":
        return {"Date": None, "Creator": creator}
    return {"Software": creator}


def figure_bytes(fig, fmt: str) -> bytes:
    """The figure rendered as ``fmt`` ("png" or "svg"), deterministically."""
    import matplotlib as mpl

    if fmt not in FORMATS:
        raise AnelabInputError(f"figure format {fmt!r} is not supported; use one of {', '.join(FORMATS)}")
    buf = io.BytesIO()
    with mpl.rc_context({"svg.hashsalt": SVG_HASH_SALT, "svg.fonttype": "path", "savefig.dpi": DPI}):
        fig.savefig(buf, format=fmt, dpi=DPI, metadata=_metadata(fmt))
    return buf.getvalue()


def _check_name(name: str) -> str:
    if not name or any(c in name for c in "/\\") or name.startswith(".") or name.endswith((".png", ".svg")):
        raise AnelabInputError(
            f"figure name {name!r} must be a bare file stem like 'mask_fold_errors' (no folder, no extension)"
        )
    return name


@contextlib.contextmanager
def _locked(directory: Path):
    """Serialise manifest updates from concurrent writers (an advisory lock on the directory itself,
    so no lock file is left beside the figures)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def read_manifest(figures_dir: str | os.PathLike = "figures") -> dict:
    """``figures_dir/MANIFEST.json`` as a dict (empty when there is none yet)."""
    path = Path(figures_dir) / MANIFEST
    if not path.exists():
        return {"figures": {}}
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise AnelabInputError(f"{path}: not valid JSON ({e.msg}); delete it and re-run the notebooks") from None
    if not isinstance(manifest.get("figures"), dict):
        raise AnelabInputError(f"{path}: has no 'figures' object; delete it and re-run the notebooks")
    return manifest


def save_figure(
    fig,
    name: str,
    *,
    figures_dir: str | os.PathLike = "figures",
    notebook: str,
    parameters: dict,
    provenance_note: str,
    caption: str | None = None,
    alt: str | None = None,
) -> dict:
    """Write ``name``.png and ``name``.svg to ``figures_dir`` and record them in its manifest.

    notebook: the notebook that drew the figure (file name); parameters: the notebook parameters
    (JSON-serialisable) it ran with; provenance_note: where the data came from (``provenance_text``).
    caption / alt: only for figures outside the study notebooks (e.g. batch summaries); a study
    figure takes them from ``captions.toml``. Returns the manifest entry: {"files": {fmt: {"path",
    "sha256", "bytes"}}, "notebook", "parameters", "provenance"} plus "caption", "alt",
    "provenance_kinds" when declared. An entry of the same name is replaced (figures are regenerated,
    unlike records); the manifest carries no dates, so it is byte-stable when the figures are.
    """
    name = _check_name(name)
    if not notebook:
        raise AnelabInputError("save_figure needs the notebook's file name (notebook=...)")
    try:
        params = json.loads(json.dumps(parameters, sort_keys=True))
    except TypeError as e:
        raise AnelabInputError(f"figure {name}: parameters must be JSON-serialisable ({e})") from None
    directory = Path(figures_dir)
    entry = {"files": {}, "notebook": str(notebook), "parameters": params, "provenance": str(provenance_note)}
    entry.update(caption_for(name) if caption is None else {"caption": caption, "alt": alt or caption})
    with _locked(directory):
        for fmt in FORMATS:
            data = figure_bytes(fig, fmt)
            atomic_write_bytes(directory / f"{name}.{fmt}", data)
            entry["files"][fmt] = {
                "path": f"{name}.{fmt}",
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
            }
        manifest = read_manifest(directory)
        manifest["figures"][name] = entry
        manifest["figures"] = dict(sorted(manifest["figures"].items()))
        atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return entry


@cache
def caption_table() -> dict[str, dict]:
    """``captions.toml`` parsed: {figure name: {"caption", "alt", "provenance": [kinds]}}."""
    table = tomllib.loads(CAPTIONS_FILE.read_text())
    for name, entry in table.items():
        kinds = entry.get("provenance") or []
        if not entry.get("caption") or not entry.get("alt") or not kinds or set(kinds) - set(PROVENANCE_KINDS):
            raise AnelabInputError(
                f"{CAPTIONS_FILE.name} [{name}]: needs caption, alt and provenance (some of {', '.join(PROVENANCE_KINDS)})"
            )
    return table


def caption_for(name: str) -> dict:
    """{"caption", "alt", "provenance_kinds"} of a study figure ({} when ``captions.toml`` has none;
    the tests require one for every figure in the committed manifest and every notebook)."""
    entry = caption_table().get(name)
    if entry is None:
        return {}
    return {"caption": entry["caption"], "alt": entry["alt"], "provenance_kinds": list(entry["provenance"])}


def annotate_manifest(figures_dir: str | os.PathLike = "figures") -> dict:
    """Copy captions, alt text and provenance kinds from ``captions.toml`` into an existing
    ``MANIFEST.json`` (no figure is redrawn); returns the manifest."""
    directory = Path(figures_dir)
    with _locked(directory):
        manifest = read_manifest(directory)
        for name, entry in manifest["figures"].items():
            entry.update(caption_for(name))
        atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _chip_short(chip: str) -> str:
    return chip[len("Apple ") :] if chip.startswith("Apple ") else chip


def _record_file(record: dict) -> str:
    if record.get("_file"):
        return str(record["_file"])
    source = record.get("source") or {}
    return str(source.get("record") or "unnamed record")


def provenance_line(record: dict) -> str:
    """One record's provenance as a figure label.

    recorded: ``recorded on <model> (<chip>), <os> — source: <file> — replayed, not measured here``
    measured: ``measured here: <model> (<chip>), <os>``
    """
    prov = record.get("provenance") or {}
    chip = _chip_short(str(prov.get("chip", "unknown")))
    machine = f"{prov.get('machine_model', 'unknown')} ({chip}), {prov.get('os_version', 'unknown')}"
    if record.get("origin") == "recorded":
        return f"recorded on {machine} — source: {_record_file(record)} — replayed, not measured here"
    if record.get("origin") == "measured":
        return f"measured here: {machine}"
    raise AnelabInputError(
        f"record {_record_file(record)} has origin {record.get('origin')!r}; expected 'measured' or 'recorded'"
    )


def measured_here_text() -> str:
    """``measured here: <this machine>`` for figures of fresh measurements made in this run."""
    m = machine_description()
    return f"measured here: {m['machine_model']} ({_chip_short(m['chip'])}), {m['os_version']}"


def numpy_cpu_note() -> str:
    """What a NumPy timing ran on: this machine's CPU and the threads this process may use (a notebook
    run beside another gets fewer) — not the ANE."""
    from anelab.sidecar.kernels import worker_count

    threads = worker_count(os.cpu_count() or 1)
    return f"NumPy on this machine's CPU, {threads} thread{'s' if threads != 1 else ''} — not the ANE"


def provenance_text(records: list[dict] | None = None) -> str:
    """Provenance of a figure's data: one line per distinct source (``measured_here_text`` if none)."""
    if not records:
        return measured_here_text()
    lines: list[str] = []
    for r in records:
        line = provenance_line(r)
        if line not in lines:
            lines.append(line)
    return "\n".join(lines)


def label_recorded(ax, record: dict, *, loc: str = "lower left") -> str:
    """Draw ``provenance_line(record)`` visibly inside ``ax`` (a corner, ``LABEL_PLACES``); returns the text."""
    return label_provenance(ax, provenance_line(record), recorded=record.get("origin") == "recorded", loc=loc)


def label_provenance(ax, text: str, *, recorded: bool, loc: str = "lower left") -> str:
    """Draw a provenance note inside ``ax``; recorded data in a warm colour, fresh in blue."""
    if loc not in LABEL_PLACES:
        raise AnelabInputError(f"label location {loc!r}: use one of {', '.join(LABEL_PLACES)}")
    x, y, ha, va = LABEL_PLACES[loc]
    colour = RECORDED_COLOUR if recorded else MEASURED_COLOUR
    note = ax.text(
        x,
        y,
        text,
        transform=ax.transAxes,
        ha=ha,
        va=va,
        fontsize=7,
        zorder=10,
        color=colour,
        bbox={"boxstyle": "round,pad=0.25", "facecolor": "white", "alpha": 0.85, "edgecolor": colour},
    )
    note.set_in_layout(False)  # a long note must not squeeze the axes
    return text


def label_measured(ax, *, loc: str = "lower left") -> str:
    """Draw ``measured here: <this machine>`` inside ``ax``."""
    return label_provenance(ax, measured_here_text(), recorded=False, loc=loc)


def label_figure(fig, records: list[dict] | None = None) -> str:
    """Provenance of a multi-panel figure as its (small, coloured) suptitle: ``provenance_text``."""
    text = provenance_text(records)
    recorded = bool(records) and all(r.get("origin") == "recorded" for r in records)
    fig.suptitle(text, fontsize=7, color=RECORDED_COLOUR if recorded else MEASURED_COLOUR)
    return text
