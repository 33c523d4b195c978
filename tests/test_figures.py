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
