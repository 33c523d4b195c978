"""Figure machinery: byte-deterministic PNG/SVG, the manifest, and provenance labels."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from anelab.errors import AnelabInputError  # noqa: E402
from anelab.records import make_record  # noqa: E402
from anelab.studies import figures

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
from anelab.studies import figures
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


def test_recorded_label_appears_in_the_svg():
    fig = _figure()
    text = figures.label_recorded(fig.axes[0], _recorded())
    assert text == RECORDED_LABEL
    assert RECORDED_LABEL in figures.figure_bytes(fig, "svg").decode()
    plt.close(fig)


def test_measured_label_and_provenance_text():
    measured = make_record("gather_probe_numpy", {}, {}, provenance_override=dict(M3))
    assert figures.provenance_line(measured) == "measured here: Mac15,3 (M3), macOS 27.0"
    assert figures.provenance_text([_recorded(), _recorded()]) == RECORDED_LABEL  # one line per distinct source
    assert figures.provenance_text().startswith("measured here: ")
    fig = _figure()
    figures.label_figure(fig, [_recorded()])
    assert RECORDED_LABEL in figures.figure_bytes(fig, "svg").decode()
    plt.close(fig)


def test_bad_input_is_refused(tmp_path):
    fig = _figure()
    with pytest.raises(AnelabInputError, match="bare file stem"):
        figures.save_figure(fig, "sub/dir", figures_dir=tmp_path, notebook="n", parameters={}, provenance_note="")
    with pytest.raises(AnelabInputError, match="JSON-serialisable"):
        figures.save_figure(
            fig, "ok", figures_dir=tmp_path, notebook="n", parameters={"x": object()}, provenance_note=""
        )
    with pytest.raises(AnelabInputError, match="label location"):
        figures.label_recorded(fig.axes[0], _recorded(), loc="middle")
    with pytest.raises(AnelabInputError, match="figure format"):
        figures.figure_bytes(fig, "pdf")
    (tmp_path / "MANIFEST.json").write_text("{not json")
    with pytest.raises(AnelabInputError, match="not valid JSON"):
        figures.read_manifest(tmp_path)
    plt.close(fig)


# ---- captions and alt text (one table: anelab/studies/captions.toml) ---------------------------------

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
    from anelab.paths import FIGURES_DIR

    manifest = figures.read_manifest(FIGURES_DIR)
    assert manifest["figures"]
    problems = [p for name, entry in manifest["figures"].items() for p in _caption_problems(name, entry)]
    assert problems == []
    # and the manifest carries what the table says (annotate_manifest / save_figure copy it)
    for name, entry in manifest["figures"].items():
        assert {k: entry[k] for k in ("caption", "alt", "provenance_kinds")} == figures.caption_for(name)


def test_caption_check_catches_a_bare_entry():
    """Negative control for the check above."""
    assert len(_caption_problems("x", {"files": {}})) == 3
    entry = {**figures.caption_for("gather_sizing"), "provenance_kinds": ["measured here"]}
    assert _caption_problems("gather_sizing", entry) == ["gather_sizing: caption does not say 'measured here'"]


def test_every_figure_a_notebook_saves_has_a_caption():
    import re

    from anelab.studies.notebooks import discover_notebooks, read_notebook

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
