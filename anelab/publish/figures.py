"""Figures of the studies: byte-deterministic PNG + SVG, a manifest, and provenance labels.

``save_figure`` writes ``<name>.png`` and ``<name>.svg`` into a figures directory and records each
file's sha256, the notebook and the parameters that made it in ``MANIFEST.json`` beside them. The
bytes depend only on the figure and the pinned matplotlib: the SVG hash salt is fixed (matplotlib
otherwise salts its element ids with a random uuid), no date goes into either file's metadata, and
the dpi is a named constant; a deterministic figure's data are rounded to what it can show
(``figure_precision``: the last bits a BLAS kernel moves never reach the files). Both files and the
manifest are written atomically (temp + rename).

Figures drawn from recorded data (a record with ``origin: "recorded"``, e.g. the seed's M3 tables)
say so in the figure's footer, below every panel and never on the data: ``label_recorded(ax, record)``
adds

    recorded on Mac15,3 (M3), macOS 27.0 — source: <record file> — replayed, not measured here

and a fresh result is labelled with the kind of machine, ``measured here: Linux x86_64, NumPy`` — not
the host (no kernel build string), so a figure that does not plot wall times is byte-identical on
every machine of the same kind. Its MANIFEST entry says ``"deterministic": true``; a figure of fresh
wall times is declared ``deterministic = false`` in ``captions.toml`` and its entry names the exact
host. ``provenance_text(records)`` is the label for a list of records (what ``save_figure`` stores
as the figure's provenance note).

Every figure's caption and alt text are declared once, in ``captions.toml`` beside this module
(``caption_for``), with the provenance kinds it draws (``PROVENANCE_KINDS``: measured here,
recorded elsewhere, predicted); ``save_figure`` copies them into the manifest entry, and
``annotate_manifest`` adds them to an existing manifest without redrawing.
A caption's facts are claims (``captions.toml``: a phrase and the facts that make it true); the
notebook passes what its figure shows to ``save_figure(facts=...)`` and ``text_problems`` compares
the two.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import math
import os
import re
import tomllib
from functools import cache
from pathlib import Path

from anelab import __version__
from anelab.core.errors import AnelabInputError
from anelab.core.records import atomic_write_bytes, atomic_write_text, machine_description, machine_kind
from anelab.publish.figure_precision import round_to_drawn_precision
from anelab.publish.provenance import compact_provenance
from anelab.sidecar.mil.kernels import worker_count

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


CAPTIONS_FILE = Path(__file__).with_name("captions.toml")


PROVENANCE_KINDS = ("measured here", "recorded elsewhere", "predicted")


RECORDED_COLOUR = "#8a4b00"


MEASURED_COLOUR = "#1f4e79"


def use_style() -> None:
    """Apply ``STYLE`` to matplotlib's rcParams (notebooks call this once, before drawing), and in a notebook show
    figures as they are saved (``show_as_saved``)."""
    import matplotlib as mpl

    mpl.rcParams.update(STYLE)
    show_as_saved()


def show_as_saved() -> bool:
    """In an IPython kernel with matplotlib's inline backend: show each figure at its own size, as ``save_figure``
    writes it, not cropped to a "tight" box. The inline backend crops by default, and that crop moves the panels
    down onto the provenance footer (which sits below the layout, outside the box it computes), so the notebooks'
    HTML showed the footer over the x-axis labels while the saved files were right. True when it applied."""
    try:
        from IPython import get_ipython
        from matplotlib_inline.backend_inline import set_matplotlib_formats
    except ImportError:
        return False
    if get_ipython() is None:
        return False
    set_matplotlib_formats("png", bbox_inches=None)
    return True


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
    deterministic: bool = True,
    facts: dict | None = None,
) -> dict:
    """Write ``name``.png and ``name``.svg to ``figures_dir`` and record them in its manifest.

    notebook: the notebook that drew the figure (file name); parameters: the notebook parameters
    (JSON-serialisable) it ran with; provenance_note: where the data came from (``provenance_text``);
    facts: what the figure shows that its caption and alt text state in words (counts, thresholds, which
    bars pass), checked against ``captions.toml`` by the tests; "panels" (``panel_count``) is added.
    caption / alt / deterministic: only for figures outside the study notebooks (e.g. batch summaries);
    a study figure takes them from ``captions.toml``. Returns the manifest entry: {"files": {fmt:
    {"path", "sha256", "bytes"}}, "notebook", "parameters", "provenance", "facts", "deterministic"} plus
    "caption", "alt", "provenance_kinds" when declared, and "host" (``machine_description()``: the
    exact machine, kernel build included) for a figure that is not deterministic — the image itself
    names only the kind of machine, so a deterministic figure and its entry are the same on every
    machine of that kind. An entry of the same name is replaced (figures are regenerated,
    unlike records); the manifest carries no dates, so it is byte-stable when the figures are.
    """
    name = _check_name(name)
    facts = {"panels": panel_count(fig), **(facts or {})}
    if not notebook:
        raise AnelabInputError("save_figure needs the notebook's file name (notebook=...)")
    try:
        params = json.loads(json.dumps(parameters, sort_keys=True))
        facts = json.loads(json.dumps(facts, sort_keys=True))
    except TypeError as e:
        raise AnelabInputError(f"figure {name}: parameters and facts must be JSON-serialisable ({e})") from None
    directory = Path(figures_dir)
    entry = {"files": {}, "notebook": str(notebook), "parameters": params, "provenance": str(provenance_note)}
    entry["facts"] = facts
    declared = caption_for(name) if caption is None else {"caption": caption, "alt": alt or caption}
    entry.update({"deterministic": deterministic, **declared})
    if not entry["deterministic"]:
        entry["host"] = machine_description()
    else:  # the same bytes under every BLAS kernel: what it draws rounded to what it can show
        round_to_drawn_precision(fig)
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


def panel_count(fig) -> int:
    """Panels of a figure: its visible axes laid out on a grid (colorbars and insets are not panels)."""
    return sum(1 for ax in fig.axes if ax.get_visible() and ax.get_subplotspec() is not None)


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
        if not isinstance(entry.get("deterministic", True), bool):
            raise AnelabInputError(f"{CAPTIONS_FILE.name} [{name}]: deterministic must be true or false")
        claims = entry.get("claims", {})
        if not isinstance(claims, dict) or not all(isinstance(facts, dict) and facts for facts in claims.values()):
            raise AnelabInputError(
                f"{CAPTIONS_FILE.name} [{name}.claims]: each phrase needs a table of the facts it states"
            )
    return table


def caption_for(name: str) -> dict:
    """{"caption", "alt", "provenance_kinds", "deterministic"} of a study figure ({} when ``captions.toml``
    has none; the tests require one for every figure in the committed manifest and every notebook)."""
    entry = caption_table().get(name)
    if entry is None:
        return {}
    return {
        "caption": entry["caption"],
        "alt": entry["alt"],
        "provenance_kinds": list(entry["provenance"]),
        "deterministic": entry.get("deterministic", True),
        "claims": dict(entry.get("claims", {})),
    }


PANEL_WORDS = {"two": 2, "three": 3, "four": 4}


def stated_panels(text: str) -> int | None:
    """How many panels a caption or alt text says the figure has: "two panels", "Left: … Right: …",
    "Top: … Bottom: …"; None when it names no panels."""
    import re

    words = re.search(r"\b(two|three|four|\d+)\s+(?:[a-z-]+\s+)?panels\b", text, re.IGNORECASE)
    if words:
        count = words.group(1).lower()
        return int(count) if count.isdigit() else PANEL_WORDS[count]
    sides = sum(
        bool(re.search(rf"\b{side}( panel)?:", text, re.IGNORECASE)) for side in ("left", "right", "top", "bottom")
    )
    return sides if sides >= 2 else None


def _same(stated, shown) -> bool:
    """A claimed fact equals the recorded one: floats to 1e-6 (also inside lists and tables), the rest exactly."""
    if isinstance(stated, list) and isinstance(shown, list):
        return len(stated) == len(shown) and all(_same(a, b) for a, b in zip(stated, shown, strict=True))
    if isinstance(stated, dict) and isinstance(shown, dict):
        return stated.keys() == shown.keys() and all(_same(stated[k], shown[k]) for k in stated)
    if isinstance(stated, bool) or isinstance(shown, bool):
        return stated is shown
    if isinstance(stated, float) or isinstance(shown, float):
        return isinstance(shown, int | float) and math.isclose(stated, shown, rel_tol=1e-6, abs_tol=1e-12)
    return stated == shown


def text_problems(name: str, entry: dict) -> list[str]:
    """Where a manifest entry's caption and alt text say something its figure does not show.

    Checked against the figure's own ``facts`` (recorded by ``save_figure`` from the data drawn):
    the number of panels the texts name, and every claim of ``captions.toml`` — a phrase that must
    appear in the caption or alt text, with the facts that make it true. Empty when they agree."""
    problems = []
    facts = entry.get("facts") or {}
    for field in ("caption", "alt"):
        stated = stated_panels(entry.get(field, ""))
        if stated is not None and stated != facts.get("panels"):
            problems.append(f"{name}: {field} names {stated} panels; the figure has {facts.get('panels')}")
    text = f"{entry.get('caption', '')} {entry.get('alt', '')}"
    for phrase, claimed in (entry.get("claims") or {}).items():
        if phrase not in text:
            problems.append(f"{name}: claim {phrase!r} is in neither the caption nor the alt text")
        for key, value in claimed.items():
            if key not in facts:
                problems.append(f"{name}: claim {phrase!r} rests on {key!r}, which the figure does not record")
            elif not _same(value, facts[key]):
                problems.append(f"{name}: {phrase!r} says {key} = {value!r}; the figure shows {facts[key]!r}")
    return problems


STATED_NUMBER = re.compile(
    r"(?<![\w.,])(?<!Qwen )(?<!Gemma )(?<!notebook )\d+(?:,\d{3})*(?:\.\d+)?(?:e-?\d+)?(?![\w.]|,\d|-bit)|\bthresholds?\b",
    re.IGNORECASE,
)  # a number in a text, not one inside a name (fp16, h0, M3, Qwen 3.8, Gemma 3, notebook 02, 4-bit), or "threshold"


def unclaimed_statements(entry: dict) -> list[str]:
    """The numbers (and "threshold" words) a caption or alt text states outside every claim phrase.

    entry: a ``captions.toml`` entry or a manifest entry ({"caption", "alt", "claims"}). A number in a
    claim phrase is checked against the figure's facts by ``text_problems``; one outside every phrase
    is checked by nothing, so a text that states a fact must declare it as a claim. Numbers that are
    part of a name (``STATED_NUMBER``) are not listed. Empty when every number is claimed."""
    phrases = list(entry.get("claims") or {})
    loose = []
    for field in ("caption", "alt"):
        text = entry.get(field, "")
        spans = [(m.start(), m.end()) for p in phrases for m in re.finditer(re.escape(p), text)]
        for match in STATED_NUMBER.finditer(text):
            if not any(start <= match.start() and match.end() <= end for start, end in spans):
                loose.append(match.group(0))
    return loose


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


def _record_file(record: dict) -> str:
    if record.get("_file"):
        return str(record["_file"])
    source = record.get("source") or {}
    return str(source.get("record") or "unnamed record")


def provenance_line(record: dict) -> str:
    """One record's provenance as a figure label, naming the kind of machine (``machine_kind``).

    recorded: ``recorded on <model> (<chip>), <os> — source: <file> — replayed, not measured here``
    measured: ``measured here: <machine kind>``
    """
    machine = machine_kind(record.get("provenance") or {})
    if record.get("origin") == "recorded":
        return f"recorded on {machine} — source: {_record_file(record)} — replayed, not measured here"
    if record.get("origin") == "measured":
        return f"measured here: {machine}"
    raise AnelabInputError(
        f"record {_record_file(record)} has origin {record.get('origin')!r}; expected 'measured' or 'recorded'"
    )


def measured_here_text(engine: str = "NumPy") -> str:
    """``measured here: <kind of machine>, <engine>`` for figures of fresh results made in this run, e.g.
    ``measured here: Linux x86_64, NumPy``. The kind, not the host: a figure must not change because the
    kernel was rebuilt (the exact host of a figure that plots wall times goes to its manifest entry)."""
    return f"measured here: {machine_kind()}, {engine}"


def numpy_cpu_note() -> str:
    """What a NumPy timing ran on: this machine's CPU and the threads this process may use (a notebook
    run beside another gets fewer) — not the ANE."""

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


# ---- the provenance footer: below every panel, never on the data -----------------------------------------

FOOTER_PT = 9  # provenance footer font size (pt)


FOOTER_LINE_PT = 1.3 * FOOTER_PT  # baseline to baseline


FOOTER_CHAR_PT = 0.6 * FOOTER_PT  # a generous mean glyph width of DejaVu Sans, to wrap long notes


def _panel_name(ax) -> str:
    """Where ``ax`` sits in its figure's grid, in words ("" for a one-panel figure)."""
    spec = ax.get_subplotspec() if hasattr(ax, "get_subplotspec") else None
    if spec is None:
        return ""
    nrows, ncols = spec.get_gridspec().get_geometry()
    if nrows * ncols == 1:
        return ""
    row, col = spec.rowspan.start, spec.colspan.start
    if nrows == 1 and ncols <= 3:
        return {2: ("left", "right"), 3: ("left", "middle", "right")}[ncols][col]
    if ncols == 1 and nrows <= 3:
        return {2: ("top", "bottom"), 3: ("top", "middle", "bottom")}[nrows][row]
    return f"panel {row * ncols + col + 1}"


def _wrapped(text: str, width_pt: float) -> list[str]:
    import textwrap

    chars = max(20, int(width_pt / FOOTER_CHAR_PT))
    return [piece for line in text.split("\n") for piece in (textwrap.wrap(line, chars) or [""])]


def _draw_footer(fig) -> None:
    """(Re)draw the figure's footer notes at the bottom, growing the figure by the footer's height so
    the panels keep their size, and keep the layout engine off the footer band."""
    for artist in fig.__dict__.pop("_anelab_footer_artists", []):
        artist.remove()
    notes = fig.__dict__["_anelab_footer"]
    base_height = fig.__dict__.setdefault("_anelab_base_height", fig.get_figheight())
    width_pt = fig.get_figwidth() * 72 - 8
    lines = [(piece, colour) for text, colour in notes for piece in _wrapped(text, width_pt)]
    footer_in = (len(lines) * FOOTER_LINE_PT + 6) / 72
    fig.set_figheight(base_height + footer_in)
    artists = []
    for i, (piece, colour) in enumerate(reversed(lines)):
        y_in = (4 + i * FOOTER_LINE_PT + 0.25 * FOOTER_PT) / 72
        t = fig.text(4 / 72, y_in, piece, transform=fig.dpi_scale_trans, fontsize=FOOTER_PT, color=colour)
        t.set_in_layout(False)
        artists.append(t)
    fig.__dict__["_anelab_footer_artists"] = artists
    share = footer_in / fig.get_figheight()
    engine = fig.get_layout_engine()
    if engine is not None and hasattr(engine, "set") and "rect" in engine.get():
        engine.set(rect=(0, share, 1, 1 - share))
    else:  # no layout engine: squeeze the subplot area above the footer
        old = fig.__dict__.setdefault("_anelab_old_share", 0.0)
        pars = fig.subplotpars
        bottom = share + (pars.bottom - old) / (1 - old) * (1 - share)
        top = share + (pars.top - old) / (1 - old) * (1 - share)
        fig.subplots_adjust(bottom=bottom, top=top)
        fig.__dict__["_anelab_old_share"] = share


def add_footer_note(fig, text: str, *, recorded: bool) -> str:
    """Add one provenance note to ``fig``'s footer (recorded data in a warm colour, fresh in blue); a note
    already there is not repeated. Returns the text."""
    notes = fig.__dict__.setdefault("_anelab_footer", [])
    if all(existing != text for existing, _ in notes):
        notes.append((text, RECORDED_COLOUR if recorded else MEASURED_COLOUR))
        _draw_footer(fig)
    return text


def footer_notes(fig) -> list[str]:
    """The provenance notes in ``fig``'s footer, in order."""
    return [text for text, _ in fig.__dict__.get("_anelab_footer", [])]


def label_recorded(ax, record: dict) -> str:
    """Note ``provenance_line(record)`` in the figure's footer, naming ``ax``'s panel; returns the text."""
    return label_provenance(ax, provenance_line(record), recorded=record.get("origin") == "recorded")


def label_provenance(ax, text: str, *, recorded: bool) -> str:
    """Note where ``ax``'s data came from in the figure's footer, below every panel and never on the
    data; in a figure of several panels the note starts with the panel's place ("left: ...").
    Returns ``text``."""
    panel = _panel_name(ax)
    add_footer_note(ax.figure, f"{panel}: {text}" if panel else text, recorded=recorded)
    return text


def label_measured(ax, engine: str = "NumPy") -> str:
    """Note ``measured here: <kind of machine>, <engine>`` in the figure's footer."""
    return label_provenance(ax, measured_here_text(engine), recorded=False)


def label_figure(fig, records: list[dict] | None = None) -> str:
    """Provenance of a whole figure in its footer: ``compact_provenance(records)`` (one line per kind of
    machine, then the sources), or ``measured_here_text()`` without records. Returns the text."""

    text = compact_provenance(records) if records else measured_here_text()
    recorded = bool(records) and all(r.get("origin") == "recorded" for r in records)
    return add_footer_note(fig, text, recorded=recorded)
