"""The selection contract: a sparse-indexed model's sidecar records selectionFolded, verify runs the
fold check for it automatically, and the loader refuses a sidecar without it."""

from __future__ import annotations

import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.core.masks import dense_exact_window
from anelab.sidecar.checks import foldcheck
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import read_sidecar_metadata

CHUNK = 16


@pytest.fixture(scope="module")
def folded(tiny_checkpoint, tmp_path_factory):
    ckpt = tiny_checkpoint("qwen3")
    [r] = export_sidecars(
        load_checkpoint(ckpt),
        tmp_path_factory.mktemp("folded"),
        CHUNK,
        [0, 32],
        [0],
        selection={"kept_blocks": 2, "compress_ratio": 4},
    )
    return ckpt, r.package


def test_contract_is_recorded(folded):
    _, pkg = folded
    meta = read_sidecar_metadata(pkg)
    assert meta.selection_folded is True
    assert meta.selection_indexer["kept_blocks"] == 2 and meta.selection_indexer["compress_ratio"] == 4
    assert meta.selection_indexer["dense_exact_window"] == 2 * 4 + 3


def test_verify_runs_the_fold_check_for_a_folded_sidecar(folded):
    ckpt, pkg = folded
    report = verify_package(pkg, load_checkpoint(ckpt))
    fold = [
        c for c in report.comparisons if c.case.startswith("fold:") or "causal-only" in c.case or "moves ref" in c.case
    ]
    assert len(fold) == 3 and all(c.function == "h32" for c in fold)
    assert report.passed, report.table()
    [main_check] = [c for c in fold if not c.control]
    assert main_check.worst < RELATIVE_ERROR_THRESHOLD


def test_fold_check_turns_vacuous_when_the_selection_keeps_everything(folded, monkeypatch):
    ckpt, pkg = folded
    real = foldcheck.selection_for
    # a selection that keeps every visible block equals the causal mask: the check must not pass
    monkeypatch.setattr(foldcheck, "selection_for", lambda case, kept, ratio, **kw: real(case, 10_000, ratio, **kw))
    report = verify_package(pkg, load_checkpoint(ckpt), functions=["h0"])
    assert not report.passed and report.vacuous


def test_loader_refuses_sparse_model_without_contract(tiny_checkpoint, tmp_path):
    from anelab.runtimes.open import open_sidecar

    [plain] = export_sidecars(load_checkpoint(tiny_checkpoint("qwen3")), tmp_path, CHUNK, [0], [0])
    with pytest.raises(AnelabInputError, match="selectionFolded"):
        open_sidecar(plain.package, compute_units="cpu_only", chunk=CHUNK, sparse_indexed=True)


def test_export_refuses_half_an_indexer(tiny_checkpoint, tmp_path, capsys):
    code = main(
        [
            "export",
            str(tiny_checkpoint("qwen3")),
            "--chunk",
            "16",
            "--histories",
            "0",
            "--layers",
            "0",
            "--selection-kept-blocks",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--selection-compress-ratio" in err[0]
    assert dense_exact_window(512, 4) == 2051
