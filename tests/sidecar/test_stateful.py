"""Stateful sidecars (K/V as Core ML state): multi-chunk prefill from disk, state carried between calls."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_GEOMETRIES

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.cli import main
from anelab.core import reference
from anelab.core.errors import AnelabInputError
from anelab.core.masks import MASKED
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, relative_error
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import STATE_CAPACITY_META, read_raw_metadata, read_sidecar_metadata, weight_bytes
from anelab.sidecar.graphs import common as graphs_common
from anelab.sidecar.mil.evaluate import SavedPackage, evaluate_with_state, new_state
from anelab.sidecar.prompt import DECODE_STEPS, run_stateful

CHUNK = 8
CAPACITY = 24
VARIANT = "qwen3_next"
LAYER = TINY_GEOMETRIES[VARIANT].full_attention_layers[-1]


@pytest.fixture(scope="module")
def package(tiny_checkpoint, tmp_path_factory):
    ckpt = tiny_checkpoint(VARIANT)
    out = tmp_path_factory.mktemp("stateful")
    assert (
        main(
            [
                "export",
                str(ckpt),
                "--chunk",
                str(CHUNK),
                "--layers",
                str(LAYER),
                "--graph",
                "stateful",
                "--capacity",
                str(CAPACITY),
                "--decode",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    return ckpt, out / f"layer_{LAYER}.mlpackage"


def test_multi_chunk_prompt_with_decode_passes_verification(package):
    ckpt, pkg = package
    meta = read_sidecar_metadata(pkg)
    assert (
        meta.graph == "stateful"
        and meta.coverage == CAPACITY
        and read_raw_metadata(pkg)[STATE_CAPACITY_META] == str(CAPACITY)
        and read_sidecar_metadata(pkg).state_capacity == CAPACITY
    )
    saved = SavedPackage(pkg)
    assert list(saved.functions) == ["c8", "c1"]
    report = verify_package(pkg, load_checkpoint(ckpt))
    assert report.passed, report.table()
    [run] = [c for c in report.comparisons if not c.control]
    assert run.rows == 2 * CHUNK + DECODE_STEPS  # two prefill chunks, then decode rows through c1
    assert 1e-5 < run.worst < RELATIVE_ERROR_THRESHOLD
    controls = {c.case: c.worst for c in report.comparisons if c.control}
    assert set(controls) == {"control: rope offset +2", "control: mask reaches graph", "control: state carried"}
    assert all(v > 10 * RELATIVE_ERROR_THRESHOLD for v in controls.values())


def test_state_is_written_at_the_chunk_start_only(package):
    """One call at start 8 fills cache slots 8..15 with the reference K of those positions; the rest
    of the (zero) cache is untouched. Independent of verify's driver."""
    ckpt, pkg = package
    ck = load_checkpoint(ckpt)
    g, w = ck.geometry, ck.layer(LAYER)
    saved = SavedPackage(pkg)
    state = new_state(saved, "c8")
    assert {k: v.shape for k, v in state.items()} == {"k_cache": (2, CAPACITY, 16), "v_cache": (2, CAPACITY, 16)}
    hidden = np.random.default_rng(1).standard_normal((CHUNK, g.hidden_size)).astype(np.float16)
    mask = np.full((CHUNK, CAPACITY), MASKED, np.float16)
    mask[:, 8:16] = np.where(np.tril(np.ones((CHUNK, CHUNK), bool)), 0, MASKED)  # attend to own chunk only
    evaluate_with_state(saved, "c8", {"hidden": hidden, "start": np.array([8], np.int32), "mask": mask}, state)
    k_ref, v_ref = reference.history_kv(
        np.concatenate([np.zeros((8, g.hidden_size)), hidden.astype(np.float64)]), w, g, "fp64"
    )
    assert relative_error(state["k_cache"][:, 8:16], k_ref[8:].transpose(1, 0, 2)) < RELATIVE_ERROR_THRESHOLD
    assert relative_error(state["v_cache"][:, 8:16], v_ref[8:].transpose(1, 0, 2)) < RELATIVE_ERROR_THRESHOLD
    assert not state["k_cache"][:, :8].any() and not state["k_cache"][:, 16:].any()
    # the same rows at start 0 would be rotated differently: the write position is not a fixed slot
    assert relative_error(state["k_cache"][:, 8:16], k_ref[:8].transpose(1, 0, 2)) > 0.05


def test_weights_are_shared_by_prefill_and_decode(package):
    _, pkg = package
    one = read_sidecar_metadata(pkg).single_function_weight_bytes
    assert 0 < weight_bytes(pkg) <= 1.05 * one


def test_second_read_state_hazard_is_caught(tiny_checkpoint, tmp_path, monkeypatch):
    """Attending over a second read_state (instead of the slice_update result): coremltools merges it
    with the first read, so the saved graph attends over the cache as it was *before* this chunk.
    The cache itself is still right — only the multi-chunk attn_out comparison catches it."""
    monkeypatch.setattr(graphs_common, "cache_for_attention", lambda mb, state, updated: mb.read_state(input=state))
    ckpt = tiny_checkpoint(VARIANT)
    [r] = export_sidecars(load_checkpoint(ckpt), tmp_path, CHUNK, None, [LAYER], graph="stateful", capacity=CAPACITY)
    fn = SavedPackage(r.package).mil_function("c8")
    assert sum(op.op_type == "read_state" for op in fn.operations) == 2  # one per state: the re-reads were merged away
    report = verify_package(r.package, load_checkpoint(ckpt))
    assert not report.passed and not report.vacuous
    [run] = [c for c in report.comparisons if not c.control]
    assert run.errors["attn_out"] > 10 * RELATIVE_ERROR_THRESHOLD
    assert run.errors["k_chunk"] < RELATIVE_ERROR_THRESHOLD and run.errors["v_chunk"] < RELATIVE_ERROR_THRESHOLD


def test_bad_stateful_requests_are_refused(package, tiny_checkpoint, tmp_path, capsys):
    ckpt, pkg = package
    with pytest.raises(AnelabInputError, match="capacity 16 is smaller than the coverage 24"):
        export_sidecars(load_checkpoint(ckpt), tmp_path, CHUNK, [0, 8, 16], [LAYER], graph="stateful", capacity=16)
    with pytest.raises(AnelabInputError, match="not a multiple of the chunk 8; use --capacity 24"):
        export_sidecars(load_checkpoint(ckpt), tmp_path, CHUNK, None, [LAYER], graph="stateful", capacity=20)
    with pytest.raises(AnelabInputError, match="needs --capacity"):
        export_sidecars(load_checkpoint(ckpt), tmp_path, CHUNK, None, [LAYER], graph="stateful")
    with pytest.raises(AnelabInputError, match="--capacity applies to --graph stateful or stateful-tiled, not dense"):
        export_sidecars(load_checkpoint(ckpt), tmp_path, CHUNK, [0], [LAYER], capacity=24)
    with pytest.raises(AnelabInputError, match="exceeds 32768"):
        export_sidecars(load_checkpoint(ckpt), tmp_path, CHUNK, None, [LAYER], graph="stateful", capacity=40000)
    # a chunk starting past the capacity is refused before it reaches the graph
    g = TINY_GEOMETRIES[VARIANT]
    with pytest.raises(AnelabInputError, match="past the state capacity 24"):
        run_stateful(SavedPackage(pkg), np.zeros((32, g.hidden_size), np.float16), CHUNK, CAPACITY)
    code = main(
        [
            "export",
            str(ckpt),
            "--chunk",
            "8",
            "--histories",
            "0,8,16",
            "--graph",
            "stateful",
            "--capacity",
            "8",
            "--out",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "smaller than the coverage" in err[0], err
    assert not any(tmp_path.glob("*.mlpackage"))


def test_plain_evaluate_refuses_a_stateful_function(package, capsys, tmp_path):
    _, pkg = package
    saved = SavedPackage(pkg)
    inputs = {s.name: np.zeros(s.shape, s.dtype) for s in saved.function("c8").inputs}
    np.savez(tmp_path / "in.npz", **inputs)
    code = main(
        [
            "evaluate",
            str(pkg),
            "--function",
            "c8",
            "--inputs",
            str(tmp_path / "in.npz"),
            "--out",
            str(tmp_path / "o.npz"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "stateful" in err[0] and "evaluate_with_state" in err[0]
