"""Figure machinery: byte-deterministic PNG/SVG, the manifest, and provenance labels."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from anelab.core.errors import AnelabInputError  # noqa: E402
from anelab.core.records import make_record  # noqa: E402
from anelab.publish import figures

M3 = {
    "machine_model": "Mac15,3",
    "chip": "Apple M3",
    "os_version": "macOS 27.0",
    "python": "unknown",
    "coremltools": "9.0",
    "numpy": "unknown",
    "anelab": "n/a",
    "git_revision": "n/a",
    "date": "unknown",
}
RECORDED_LABEL = "recorded on Mac15,3 (M3), macOS 27.0 — source: probe-m3.json — replayed, not measured here"

DRAW = """
import matplotlib; matplotlib.use("Agg")
import matplotlib.pyplot as plt
from anelab.publish import figures
figures.use_style()
fig, ax = plt.subplots(figsize=(3, 2))
ax.plot([1, 2, 3], [3, 1, 2], label="a"); ax.set_title("probe"); ax.legend()
"""


def _figure():
    namespace: dict = {}
    exec(DRAW, namespace)
    return namespace["fig"]


def _recorded():
    record = make_record(
        "gather_probe",
        {},
        {"rows": []},
        origin="recorded",
        provenance_override=dict(M3),
        source={"document": "seed", "record": "benchmark output"},
    )
    return {**record, "_file": "probe-m3.json"}


def test_same_figure_twice_gives_identical_bytes():
    fig = _figure()
    for fmt in figures.FORMATS:
        assert figures.figure_bytes(fig, fmt) == figures.figure_bytes(fig, fmt)
    svg = figures.figure_bytes(fig, "svg").decode()
    assert "<dc:date>" not in svg  # no save time in the metadata
    plt.close(fig)


def test_svg_without_the_fixed_salt_is_not_deterministic():
    """Negative control: matplotlib's default random salt makes two saves differ, so the check above can fail."""
    import io

    fig = _figure()
    outs = []
    for _ in range(2):
        buf = io.BytesIO()
        with matplotlib.rc_context({"svg.hashsalt": None}):
            fig.savefig(buf, format="svg", metadata={"Date": None})
        outs.append(buf.getvalue())
    assert outs[0] != outs[1]
    plt.close(fig)


@pytest.mark.blas_exact
def test_bytes_identical_across_processes():
    code = (
        DRAW
        + "import hashlib, sys\nfor f in figures.FORMATS: print(hashlib.sha256(figures.figure_bytes(fig, f)).hexdigest())"
    )
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        for _ in range(2)
    ]
    fig = _figure()
    here = [hashlib.sha256(figures.figure_bytes(fig, f)).hexdigest() for f in figures.FORMATS]
    assert runs[0] == runs[1] == here
    plt.close(fig)


def test_save_figure_writes_files_and_manifest(tmp_path):
    fig = _figure()
    entry = figures.save_figure(
        fig,
        "probe_plot",
        figures_dir=tmp_path,
        notebook="03_gather_sizing.ipynb",
        parameters={"quick": True, "chunks": [32]},
        provenance_note="measured here: test",
    )
    manifest = json.loads((tmp_path / "MANIFEST.json").read_text())
    assert manifest["figures"]["probe_plot"] == entry
    for fmt in ("png", "svg"):
        data = (tmp_path / f"probe_plot.{fmt}").read_bytes()
        assert entry["files"][fmt]["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["files"][fmt]["bytes"] == len(data)
    assert entry["notebook"] == "03_gather_sizing.ipynb" and entry["parameters"] == {"quick": True, "chunks": [32]}
    before = (tmp_path / "MANIFEST.json").read_bytes()
    figures.save_figure(
        fig,
        "probe_plot",
        figures_dir=tmp_path,
        notebook="03_gather_sizing.ipynb",
        parameters={"quick": True, "chunks": [32]},
        provenance_note="measured here: test",
    )
    assert (tmp_path / "MANIFEST.json").read_bytes() == before  # no dates: regenerating is byte-stable
    figures.save_figure(
        fig, "another", figures_dir=tmp_path, notebook="02_mask_fold.ipynb", parameters={}, provenance_note="x"
    )
    assert set(json.loads((tmp_path / "MANIFEST.json").read_text())["figures"]) == {"another", "probe_plot"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "MANIFEST.json",
        "another.png",
        "another.svg",
        "probe_plot.png",
        "probe_plot.svg",
    ]  # no temp or lock files
    plt.close(fig)


def _svg_texts(svg: bytes) -> list[str]:
    """The text of every label in a matplotlib SVG (glyphs are paths; each label's text is a comment)."""
    return re.findall(r"<!-- (.*?) -->", svg.decode())


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _footer_clear_of_panels(fig) -> bool:
    """Every footer note lies below every panel's full extent (tick labels and axis labels included)."""
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    notes = [t for t in fig.texts if t.get_text()]
    panels = [ax.get_tightbbox(renderer) for ax in fig.axes]
    return bool(notes) and not any(_overlaps(t.get_window_extent(renderer), p) for t in notes for p in panels)


def test_recorded_label_goes_to_the_footer_below_the_data():
    fig = _figure()
    height = fig.get_figheight()
    text = figures.label_recorded(fig.axes[0], _recorded())
    assert text == RECORDED_LABEL and figures.footer_notes(fig) == [RECORDED_LABEL]
    pieces = [t.get_text() for t in sorted(fig.texts, key=lambda t: -t.get_position()[1])]
    assert len(pieces) > 1 and " ".join(pieces) == RECORDED_LABEL  # wrapped to the figure's width
    assert set(pieces) <= set(_svg_texts(figures.figure_bytes(fig, "svg")))  # every piece drawn
    assert fig.get_figheight() > height  # the figure grows; the panel keeps its size
    assert _footer_clear_of_panels(fig)
    figures.label_recorded(fig.axes[0], _recorded())
    assert figures.footer_notes(fig) == [RECORDED_LABEL]  # a note is not repeated
    plt.close(fig)


def test_a_note_inside_the_axes_is_caught_as_on_the_data():
    """Negative control for the footer check: the old corner label (inside the axes) overlaps the panel."""
    fig = _figure()
    fig.axes[0].text(0.01, 0.02, "measured here", transform=fig.axes[0].transAxes)
    assert not _footer_clear_of_panels(fig)
    plt.close(fig)


def test_panel_notes_name_their_panel():
    figures.use_style()
    fig, (left, right) = plt.subplots(1, 2, figsize=(6, 2))
    figures.label_provenance(right, "planner", recorded=True)
    figures.label_figure(fig, [_recorded()])
    assert figures.footer_notes(fig) == [
        "right: planner",
        "recorded on Mac15,3 (M3), macOS 27.0 — replayed, not measured here\nsource: probe-m3.json",
    ]
    assert _footer_clear_of_panels(fig)
    plt.close(fig)


def test_measured_label_and_provenance_text():
    measured = make_record("gather_probe_numpy", {}, {}, provenance_override=dict(M3))
    assert figures.provenance_line(measured) == "measured here: Mac15,3 (M3), macOS 27.0"
    assert figures.provenance_text([_recorded(), _recorded()]) == RECORDED_LABEL  # one line per distinct source
    assert figures.provenance_text().startswith("measured here: ")
    linux = {"machine_model": "Linux x86_64", "chip": "x86_64", "os_version": "Linux 6.18.44-fc-v595"}
    on_linux = make_record("gather_probe_numpy", {}, {}, provenance_override={**M3, **linux})
    assert figures.provenance_line(on_linux) == "measured here: Linux x86_64"  # the kind, not the kernel build
    plt.close("all")


# ---- host-independent figures ------------------------------------------------------------------------

LINUX_HOST = {"system": "Linux", "machine": "x86_64", "processor": "x86_64"}


def _draw_and_save(tmp_path, monkeypatch, release: str, machine: str = "x86_64", name: str = "gather_sizing"):
    """Draw and save a figure labelled the way the study notebooks label it, on a host whose kernel
    build string is ``release``: (png bytes, svg bytes, manifest entry)."""
    import platform

    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(platform, "processor", lambda: machine)
    monkeypatch.setattr(platform, "release", lambda: release)
    monkeypatch.setattr(sys, "platform", "linux")
    fig = _figure()
    figures.label_measured(fig.axes[0])
    here = make_record("tiled_stateful_numpy", {}, {})
    figures.label_figure(fig, [here])
    out = tmp_path / release / machine
    entry = figures.save_figure(
        fig, name, figures_dir=out, notebook="n.ipynb", parameters={}, provenance_note=figures.provenance_text([here])
    )
    plt.close(fig)
    return (out / f"{name}.png").read_bytes(), (out / f"{name}.svg").read_bytes(), entry


def test_a_deterministic_figure_is_identical_on_another_host_of_the_same_kind(tmp_path, monkeypatch):
    png_a, svg_a, entry_a = _draw_and_save(tmp_path, monkeypatch, "6.18.44-fc-v595")
    png_b, svg_b, entry_b = _draw_and_save(tmp_path, monkeypatch, "6.18.44-fc-v657")
    assert (png_a, svg_a) == (png_b, svg_b)
    assert entry_a == entry_b and entry_a["deterministic"] is True and "host" not in entry_a
    assert "measured here: Linux x86_64, NumPy" in _svg_texts(svg_a)
    assert not any("6.18" in t for t in _svg_texts(svg_a)) and "6.18" not in json.dumps(entry_a)


def test_another_kind_of_machine_changes_the_figure(tmp_path, monkeypatch):
    """Negative control: the label is drawn and names the kind, so an arm64 host gives other bytes."""
    png_a, svg_a, _ = _draw_and_save(tmp_path, monkeypatch, "6.18.44-fc-v595")
    png_b, svg_b, _ = _draw_and_save(tmp_path, monkeypatch, "6.18.44-fc-v595", machine="aarch64")
    assert png_a != png_b and svg_a != svg_b


def test_a_wall_time_figure_is_marked_and_names_its_exact_host(tmp_path, monkeypatch):
    _, _, entry = _draw_and_save(tmp_path, monkeypatch, "6.18.44-fc-v657", name="tiled_stateful_numpy_time")
    assert entry["deterministic"] is False
    assert entry["host"]["os_version"] == "Linux 6.18.44-fc-v657"  # the exact host: manifest only


def test_committed_manifest_says_which_figures_are_deterministic():
    from anelab.core.paths import FIGURES_DIR

    manifest = figures.read_manifest(FIGURES_DIR)["figures"]
    assert {name for name, e in manifest.items() if not e["deterministic"]} == {"tiled_stateful_numpy_time"}
    for name, entry in manifest.items():
        assert ("host" in entry) is (not entry["deterministic"]), name
        if entry["deterministic"]:  # no kernel build string in the entry of a figure that any host redraws
            assert not re.search(r"Linux \d+\.\d+", json.dumps(entry)), name


def test_bad_input_is_refused(tmp_path):
    fig = _figure()
    with pytest.raises(AnelabInputError, match="bare file stem"):
        figures.save_figure(fig, "sub/dir", figures_dir=tmp_path, notebook="n", parameters={}, provenance_note="")
    with pytest.raises(AnelabInputError, match="JSON-serialisable"):
        figures.save_figure(
            fig, "ok", figures_dir=tmp_path, notebook="n", parameters={"x": object()}, provenance_note=""
        )
    with pytest.raises(AnelabInputError, match="figure format"):
        figures.figure_bytes(fig, "pdf")
    (tmp_path / "MANIFEST.json").write_text("{not json")
    with pytest.raises(AnelabInputError, match="not valid JSON"):
        figures.read_manifest(tmp_path)
    plt.close(fig)


# ---- captions and alt text (one table: anelab/publish/captions.toml) ---------------------------------

KIND_WORDS = {"measured here": "measured here", "recorded elsewhere": "recorded elsewhere", "predicted": "predicted"}


def _caption_problems(name: str, entry: dict) -> list[str]:
    problems = []
    if not entry.get("caption"):
        problems.append(f"{name}: no caption")
    if not entry.get("alt"):
        problems.append(f"{name}: no alt text")
    kinds = entry.get("provenance_kinds") or []
    if not kinds or set(kinds) - set(figures.PROVENANCE_KINDS):
        problems.append(f"{name}: provenance kinds {kinds}")
    for kind in kinds:
        if KIND_WORDS[kind] not in entry.get("caption", "").lower():
            problems.append(f"{name}: caption does not say '{kind}'")
    return problems


def test_every_committed_figure_has_a_caption_alt_text_and_provenance_kind():
    from anelab.core.paths import FIGURES_DIR

    manifest = figures.read_manifest(FIGURES_DIR)
    assert manifest["figures"]
    problems = [p for name, entry in manifest["figures"].items() for p in _caption_problems(name, entry)]
    assert problems == []
    # and the manifest carries what the table says (annotate_manifest / save_figure copy it)
    # (claims: a claim added to the table after the figures were drawn is checked against the committed
    # facts by tests/publish/test_texts.py; after `anelab reproduce` the two are equal)
    for name, entry in manifest["figures"].items():
        declared = figures.caption_for(name)
        keys = ("caption", "alt", "provenance_kinds", "deterministic")
        assert {k: entry[k] for k in keys} == {k: declared[k] for k in keys}
        assert all(declared["claims"].get(phrase) == facts for phrase, facts in entry["claims"].items()), name


def test_caption_check_catches_a_bare_entry():
    """Negative control for the check above."""
    assert len(_caption_problems("x", {"files": {}})) == 3
    entry = {**figures.caption_for("gather_sizing"), "provenance_kinds": ["measured here"]}
    assert _caption_problems("gather_sizing", entry) == ["gather_sizing: caption does not say 'measured here'"]


def test_every_figure_a_notebook_saves_has_a_caption():
    import re

    from anelab.publish.notebooks import discover_notebooks, read_notebook

    names = set()
    for path in discover_notebooks():
        source = "".join("".join(c["source"]) for c in read_notebook(path)["cells"])
        names |= set(re.findall(r'save_figure\(\s*fig,\s*"([a-z0-9_]+)"', source))
    assert len(names) >= 25
    assert sorted(n for n in names if not figures.caption_for(n)) == []
    assert figures.caption_for("no_such_figure") == {}  # control: an undeclared name has none


def test_save_figure_and_annotate_copy_the_caption(tmp_path):
    fig = _figure()
    entry = figures.save_figure(
        fig,
        "gather_sizing",
        figures_dir=tmp_path,
        notebook="03_gather_sizing.ipynb",
        parameters={},
        provenance_note="x",
    )
    assert entry["caption"].startswith("Bytes of the gathered keys") and entry["provenance_kinds"] == ["predicted"]
    custom = figures.save_figure(
        fig, "summary_x", figures_dir=tmp_path, notebook="n", parameters={}, provenance_note="x", caption="c", alt="a"
    )
    assert (custom["caption"], custom["alt"]) == ("c", "a")
    manifest = json.loads((tmp_path / "MANIFEST.json").read_text())
    del manifest["figures"]["gather_sizing"]["caption"]
    (tmp_path / "MANIFEST.json").write_text(json.dumps(manifest))
    annotated = figures.annotate_manifest(tmp_path)
    assert annotated["figures"]["gather_sizing"]["caption"] == entry["caption"]
    assert annotated["figures"]["summary_x"]["caption"] == "c"  # an undeclared figure keeps its own
    plt.close(fig)


def test_a_caption_table_entry_without_alt_text_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "captions.toml"
    bad.write_text('[a]\ncaption = "c"\nprovenance = ["predicted"]\n')
    monkeypatch.setattr(figures, "CAPTIONS_FILE", bad)
    figures.caption_table.cache_clear()
    try:
        with pytest.raises(AnelabInputError, match=r"\[a\]: needs caption, alt and provenance"):
            figures.caption_table()
    finally:
        figures.caption_table.cache_clear()


# ---- readable at gallery size ------------------------------------------------------------------------

GALLERY_TEXT_PT = 720  # the gallery's column: max-width 62rem less 2 x 1rem padding = 960 px = 720 pt at 100 %


MIN_TICK_PT = 9


def tick_label_sizes(svg: bytes) -> list[float]:
    """Point size at which each tick label of a matplotlib SVG shows in the gallery at 100 % zoom.

    Glyphs are paths, each label a group ``scale(s -s)`` with s = size / 100; a figure wider than the
    gallery's column is scaled down to it. Superscripts (``10^-3``) are drawn smaller inside a label
    by design and are not counted."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(svg)
    shrink = min(1.0, GALLERY_TEXT_PT / float(root.get("width").removesuffix("pt")))
    sizes = []
    for group in root.iter("{http://www.w3.org/2000/svg}g"):
        if re.fullmatch(r"[xy]tick_\d+", group.get("id") or ""):
            for label in group.iter("{http://www.w3.org/2000/svg}g"):
                m = re.search(r"scale\(([0-9.]+) -", label.get("transform") or "")
                if m:
                    sizes.append(round(float(m.group(1)) * 100 * shrink, 2))
    return sizes


def test_every_committed_figure_has_tick_labels_of_9_pt_at_gallery_size():
    from anelab.core.paths import FIGURES_DIR

    small = {}
    for svg in sorted(FIGURES_DIR.glob("*.svg")):
        sizes = tick_label_sizes(svg.read_bytes())
        assert sizes, svg.name
        if min(sizes) < MIN_TICK_PT:
            small[svg.stem] = min(sizes)
    assert small == {}


def test_small_or_shrunk_tick_labels_are_caught():
    """Negative controls: 6 pt tick labels (the old tiled_stateful_errors), and 9 pt labels on a figure
    wider than the gallery, which the browser scales down."""
    figures.use_style()
    fig, ax = plt.subplots(figsize=(4, 2))
    ax.set_xticks([0, 1], ["a", "b"], fontsize=6)
    assert min(tick_label_sizes(figures.figure_bytes(fig, "svg"))) == 6.0
    wide, _ = plt.subplots(figsize=(11, 2))
    assert min(tick_label_sizes(figures.figure_bytes(wide, "svg"))) == round(9 * 720 / 792, 2)
    plt.close("all")


def text_sizes(svg: bytes) -> list[float]:
    """Point size at gallery size of every text of a matplotlib SVG: tick labels, legend entries,
    annotations, bar labels, titles, axis labels and the footer. Each text is a group ``text_N``; its
    size is that of its largest glyphs (a superscript inside a label is smaller by design)."""
    import xml.etree.ElementTree as ET

    svg_group = "{http://www.w3.org/2000/svg}g"
    root = ET.fromstring(svg)
    shrink = min(1.0, GALLERY_TEXT_PT / float(root.get("width").removesuffix("pt")))
    sizes = []
    for group in root.iter(svg_group):
        if re.fullmatch(r"text_\d+", group.get("id") or ""):
            scales = [re.search(r"scale\(([0-9.]+) -", g.get("transform") or "") for g in group.iter(svg_group)]
            scales = [float(m.group(1)) for m in scales if m]
            if scales:
                sizes.append(round(max(scales) * 100 * shrink, 2))
    return sizes


def test_every_committed_figure_has_text_of_9_pt_at_gallery_size():
    from anelab.core.paths import FIGURES_DIR

    small = {svg.stem for svg in FIGURES_DIR.glob("*.svg") if min(text_sizes(svg.read_bytes())) < MIN_TICK_PT}
    assert small == set()  # legends, annotations, ticks and titles alike (the size check reads every text)


def test_small_legend_and_annotation_text_is_caught():
    """Negative controls: a 7 pt legend and a 6 pt annotation (as in the older figures) are caught; the
    same figure at the style's default size passes."""
    figures.use_style()

    def sizes(**small):
        fig, ax = plt.subplots(figsize=(4, 2))
        ax.plot([0, 1], [0, 1], label="line")
        ax.legend(fontsize=small.get("legend"))
        ax.annotate("point", (0.5, 0.5), fontsize=small.get("note"))
        return text_sizes(figures.figure_bytes(fig, "svg"))

    assert min(sizes()) >= MIN_TICK_PT
    assert min(sizes(legend=7)) == 7.0
    assert min(sizes(note=6)) == 6.0
    plt.close("all")


SMALL_FONT = re.compile(r"\bfontsize\s*=\s*(?:([0-9.]+)|[\"'](?:x+-)?small[\"'])")


def small_font_settings(source: str) -> list[str]:
    """Text sizes below 9 pt that a notebook cell sets (``fontsize=7``, ``fontsize="small"``)."""
    return [m.group(0) for m in SMALL_FONT.finditer(source) if m.group(1) is None or float(m.group(1)) < MIN_TICK_PT]


def test_no_notebook_or_study_sets_text_below_9_pt():
    """The notebooks and anelab/studies draw every figure; the committed SVGs follow after `anelab reproduce`."""
    from pathlib import Path

    import anelab.studies
    from anelab.publish.notebooks import discover_notebooks, read_notebook

    found = {
        path.name: small_font_settings("".join("".join(c["source"]) for c in read_notebook(path)["cells"]))
        for path in discover_notebooks()
    }
    assert len(found) >= 7
    found |= {p.name: small_font_settings(p.read_text()) for p in Path(anelab.studies.__file__).parent.glob("*.py")}
    assert all(v == [] for v in found.values()), found
    # negative controls: the old cells of mask_fold_checks and arms_per_layer_difference
    assert small_font_settings('ax.bar_label(bars, fontsize=6); ax.legend(fontsize=6.5, loc="upper left")') == [
        "fontsize=6",
        "fontsize=6.5",
    ]
    assert small_font_settings('ax.legend(fontsize="x-small"); ax.set_title("t", fontsize=10)') == [
        'fontsize="x-small"'
    ]
