"""``anelab verify EXPORT_DIR``: every package verified, one progress bar, one summary table, exit 1 if any fails."""

from __future__ import annotations

import shutil

import pytest
from conftest import TINY_GEOMETRIES

from anelab.checkpoints.checkpoint import load_checkpoint, write_checkpoint
from anelab.cli import main
from anelab.core.weights import random_attention_weights
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import META, read_raw_metadata, write_package_metadata

CHUNK = 4


def _without_digests(package) -> None:
    """The package as exported before packages recorded tensor digests (only the numbers can tell it apart)."""
    staged = package.with_name("legacy-" + package.name)
    write_package_metadata(package, staged, {**read_raw_metadata(package), META["source_tensors"]: "null"})
    shutil.rmtree(package)
    staged.rename(package)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("verify-dir")
    good = tiny_checkpoint("llama")
    export_sidecars(load_checkpoint(good), root / "good", CHUNK, [0, CHUNK])
    g = TINY_GEOMETRIES["llama"]
    other = write_checkpoint(root / "other", g, {i: random_attention_weights(g, i, seed=99) for i in (0, 1)})
    export_sidecars(load_checkpoint(other), root / "other-sidecars", CHUNK, [0], layers=[1])
    mixed = root / "mixed"
    shutil.copytree(root / "good" / "layer_0.mlpackage", mixed / "layer_0.mlpackage")
    shutil.copytree(root / "other-sidecars" / "layer_1.mlpackage", mixed / "layer_1.mlpackage")
    _without_digests(mixed / "layer_1.mlpackage")
    return root, good


def test_every_package_is_verified_under_one_progress_bar_and_one_table(exports, capsys):
    root, _ = exports
    assert main(["verify", str(root / "good")]) == 0
    out, err = capsys.readouterr()
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["0", "1"] and all(r[1] == "dense" and r[-1] == "ok" for r in rows)
    assert "PASSED: every package" in out and out.count("verify ") == 1
    assert "verify packages" in err and "verify:" not in err  # the packages' own bars stay quiet


def test_one_failing_package_fails_the_directory_and_is_named(exports, capsys):
    """Negative control: layer 1 holds another model's weights (and no digests to refuse it up front)."""
    root, good = exports
    assert main(["verify", str(root / "mixed"), "--checkpoint", str(good)]) == 1
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()}
    assert rows["0"][-1] == "ok" and rows["1"][-1] == "FAIL"
    assert "FAILED: layer 1" in out


def test_json_lists_each_layer_with_its_worst_error_and_control_margin(exports, capsys):
    import json

    root, _ = exports
    assert main(["verify", str(root / "good"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and [r["layer"] for r in report["layers"]] == [0, 1]
    for r in report["layers"]:
        assert 0 < r["worst_error"] <= r["worst_bound"] and r["weakest_control_margin"] > 1


def test_a_directory_without_packages_is_refused_in_one_line(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds no layer_<L>.mlpackage" in err


def test_an_export_directorys_table_reports_the_compression_cost_without_judging_it():
    """A compressed layer's cost against the uncompressed weights is its own column, never its worst error nor a
    failure; the judged worst error is the graph's. Control: a graph row above the threshold fails the layer."""
    from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, Comparison
    from anelab.sidecar.checks.verify_cases import VerifyReport, compression_row
    from anelab.sidecar.checks.verify_export import ExportVerifyReport, LayerVerdict

    def verdict(graph_error: float) -> LayerVerdict:
        rows = [Comparison("h0", "full chunk", 8, {"attn_out": graph_error}),
                Comparison("h0", "control: rope offset +1", 8, {"attn_out": 0.5}, control=True),
                compression_row("h0", "int8", 8, {"attn_out": 0.06})]  # fmt: skip
        report = VerifyReport("p", "c", 0, RELATIVE_ERROR_THRESHOLD, "numpy", rows,
                              declared_controls=[("h0", "control: rope offset +1")])  # fmt: skip
        return LayerVerdict(0, "layer_0.mlpackage", "dense int8", report)

    ok = verdict(2e-3)
    assert ok.worst.worst == 2e-3 and ok.compression_cost == 0.06 and ok.report.passed
    table = ExportVerifyReport("d", [ok]).table()
    assert "compression cost (vs uncompressed weights; not judged)" in table and "6.00e-02" in table
    assert table.splitlines()[-1] == "PASSED: every package"
    assert not ExportVerifyReport("d", [verdict(2e-2)]).passed
