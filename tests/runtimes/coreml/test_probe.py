"""Gather-graph probes (anelab.studies.gather_sizing): built, saved, inspected and evaluated from disk.

The truth here is a dense masked softmax written in this file (a different formulation from
``gather.selected_attention``, which walks the rows); byte sizes are hand formulas of the shapes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.core.masks import dense_exact_window
from anelab.core.records import read_records
from anelab.runtimes.coreml.coreml_fake import FakeFunction, FakeRuntime
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, relative_error
from anelab.studies import gather_sizing as gather

HEADS, HEAD_DIM, CHUNK, HISTORY = 2, 16, 8, 24  # total 32 keys
KEPT_BLOCKS, RATIO = 2, 4  # budget 11


def masked_softmax_attention(q, k, v, keep_indices, keep_counts):
    """Dense float64 attention with -inf on every key a row does not keep."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    chunk, total = q.shape[1], k.shape[1]
    allowed = np.zeros((chunk, total), bool)
    for i in range(chunk):
        allowed[i, keep_indices[i, : keep_counts[i]]] = True
    s = np.einsum("hcd,htd->hct", q, k) / np.sqrt(q.shape[-1])
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("hct,htd->hcd", p / p.sum(axis=-1, keepdims=True), v)


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    out = tmp_path_factory.mktemp("probes")
    shape = gather.ProbeShape(HEADS, HEAD_DIM, CHUNK, HISTORY, dense_exact_window(KEPT_BLOCKS, RATIO))
    inputs = gather.probe_inputs(shape, KEPT_BLOCKS, RATIO, seed=4)
    results = {g: gather.run_probe(g, shape, inputs, out, repeats=2) for g in gather.PROBE_GRAPHS}
    return shape, inputs, results


def test_selected_attention_matches_masked_softmax(probes):
    _, inputs, _ = probes
    sel = inputs.selection
    rows = gather.selected_attention(inputs.q, inputs.k, inputs.v, sel.keep_indices, sel.keep_counts)
    dense = masked_softmax_attention(inputs.q, inputs.k, inputs.v, sel.keep_indices, sel.keep_counts)
    np.testing.assert_allclose(rows, dense, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("graph", gather.PROBE_GRAPHS)
def test_saved_probe_agrees_with_numpy_and_control_fails(probes, graph):
    shape, inputs, results = probes
    r = results[graph]
    assert r.package.is_dir() and r.package.suffix == ".mlpackage"
    assert r.relative_error < RELATIVE_ERROR_THRESHOLD
    assert r.control_error > 10 * RELATIVE_ERROR_THRESHOLD
    assert r.agrees
    assert len(r.numpy_eval_seconds) == 2 and all(t > 0 for t in r.numpy_eval_seconds)
    # evaluate the saved package again here and compare with this file's truth
    from anelab.sidecar.mil.evaluate import evaluate

    sel = inputs.selection
    out = evaluate(r.package, "main", inputs.for_graph(graph))["out"]
    truth = masked_softmax_attention(inputs.q, inputs.k, inputs.v, sel.keep_indices, sel.keep_counts)
    assert relative_error(out, truth) < RELATIVE_ERROR_THRESHOLD
    # negative control: shifting every kept index by one key is caught
    shifted = np.where(
        np.arange(shape.budget)[None, :] < sel.keep_counts[:, None], np.maximum(sel.keep_indices - 1, 0), 0
    ).astype(np.int32)
    if graph == "gather":
        wrong = evaluate(r.package, "main", {**inputs.for_graph(graph), "keep_indices": shifted})["out"]
        assert relative_error(wrong, truth) > RELATIVE_ERROR_THRESHOLD


def test_op_counts_and_arena_bytes(probes):
    shape, _, results = probes
    dense, gath = results["full-scores"], results["gather"]
    assert "gather" not in dense.op_counts and dense.op_counts["softmax"] == 1 and dense.op_counts["matmul"] == 2
    assert gath.op_counts["gather"] == 1 and gath.op_counts["softmax"] == 1
    # dense: the [H, C, T] fp16 score arena is the biggest tensor (T=32 > d=16)
    assert dense.largest_intermediate_bytes == HEADS * CHUNK * (HISTORY + CHUNK) * 2
    assert dense.arena_bytes == HEADS * CHUNK * (HISTORY + CHUNK) * 2
    # gather: gathered keys and values [H, C, budget, 2d] fp16 (budget 11)
    assert gath.largest_intermediate_bytes == HEADS * CHUNK * 11 * 2 * HEAD_DIM * 2
    assert gath.arena_bytes == gath.largest_intermediate_bytes
    assert gath.to_dict()["ops"] == sum(gath.op_counts.values())


def test_converter_narrows_small_gather_indices_to_int16(probes):
    """coremltools 9.0's add_int16_cast narrows the indices when the gathered axis has <= 32,767 keys."""
    _, _, results = probes
    narrowing = results["gather"].index_narrowing
    assert narrowing and {c["dtype"] for c in narrowing} == {"int16"}
    assert all(c["limit"] == 32767 for c in narrowing)
    assert results["full-scores"].index_narrowing == []


def test_positions_past_int16_are_gathered_correctly(tmp_path):
    """At 40,002 keys the converter keeps int32 indices, and keys past 32,767 come back right."""
    results = gather.probe(
        2,
        heads=1,
        head_dim=8,
        history=40000,
        kept_blocks=2,
        compress_ratio=4,
        repeats=1,
        out_dir=tmp_path,
        graphs=("gather",),
    )
    r = results[0]
    assert r.shape.total == 40002 and r.index_narrowing == []
    assert r.agrees and r.relative_error < RELATIVE_ERROR_THRESHOLD


def _explicit_int16_program(total: int):
    from anelab.sidecar.coremltools_import import coremltools_modules

    ct, mb, types = coremltools_modules()

    @mb.program(
        input_specs=[mb.TensorSpec((1, total, 4), types.fp16), mb.TensorSpec((2, 3), types.int32)],
        opset_version=ct.target.iOS18,
    )
    def prog(k, idx):
        return mb.gather(x=k, indices=mb.cast(x=idx, dtype="int16"), axis=1, name="out")

    return prog


def test_narrowed_indices_past_32767_are_refused(tmp_path):
    from anelab.sidecar.export import convert_program
    from anelab.sidecar.mil.evaluate import SavedPackage

    wide = SavedPackage(convert_program(_explicit_int16_program(40000), tmp_path / "wide.mlpackage"))
    narrowing = gather.index_narrowing(wide)
    assert [c["dtype"] for c in narrowing] == ["int16"]
    with pytest.raises(AnelabInputError, match="past 32,767 would wrap"):
        gather.check_index_range(narrowing, 40000)
    gather.check_index_range(narrowing, 32768)  # position 32,767 still fits


def test_probe_shape_and_inputs_validation():
    with pytest.raises(AnelabInputError, match="exceeds total keys"):
        gather.ProbeShape(2, 16, 8, 0, 11)
    with pytest.raises(AnelabInputError, match="history"):
        gather.ProbeShape(2, 16, 8, -1, 4)
    shape = gather.ProbeShape(2, 16, 8, 24, 11)
    with pytest.raises(AnelabInputError, match="budget 11 is not"):
        gather.probe_inputs(shape, 1, 4)
    with pytest.raises(AnelabInputError, match="unknown probe graph"):
        gather.save_probe("sparse", shape, ".")


def test_cli_probe_json_and_record(tmp_path, capsys):
    rc = main(
        [
            "probe",
            "--chunk",
            "8",
            "--repeats",
            "1",
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--json",
            "--records",
            str(tmp_path),
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["graph"] for r in out["rows"]] == ["full-scores", "gather"]
    assert all(r["agrees"] for r in out["rows"])
    assert out["rows"][0]["total"] == 32 and out["rows"][0]["budget"] == 19
    assert "not ANE" in out["timing"]
    recs = read_records(tmp_path, kind="gather_probe_numpy")
    assert len(recs) == 1 and recs[0]["origin"] == "measured"


def test_cli_probe_bad_input(capsys):
    assert main(["probe", "--chunk", "0"]) == 2
    assert "chunk must be a positive integer" in capsys.readouterr().err


def test_measure_probes_on_runtime_with_fake(probes, tmp_path):
    shape, inputs, results = probes
    runtime = FakeRuntime(
        default=FakeFunction(assignment={"neural_engine": 9, "gpu": 0, "cpu": 1}, predict_default_s=0.25)
    )
    rows = gather.measure_probes_on_runtime(
        runtime, list(results.values()), inputs, tmp_path, repeats=2, clock=runtime.clock
    )
    assert [r["graph"] for r in rows] == ["full-scores", "gather"]
    assert rows[1]["assignment"]["neural_engine"] == 9
    assert rows[1]["predict"]["median_s"] == pytest.approx(0.27)  # + 0.02 s converting the outputs
    assert rows[1]["predict"]["core_ml_predict_s"]["median_s"] == pytest.approx(0.25)
    # the probes never passed the ANE gate: their cpu_and_ne predicts ran in a child process only
    assert [c for c in runtime.calls if c[0] == "predict"] == []
    assert {c[3] for c in runtime.child_calls() if c[0] == "predict"} == {"cpu_and_ne"}
    assert rows[1]["load"]["median_s"] == pytest.approx(6.0)  # every timed load is cold (a fresh copy)
    assert len(read_records(tmp_path)) == 4  # load + predict record per probe
    off = FakeRuntime(available=False)
    with pytest.raises(AnelabInputError):
        gather.measure_probes_on_runtime(off, list(results.values()), inputs, tmp_path)


@pytest.mark.parametrize("recorded_as", ["dense", "full-scores"])
def test_a_record_from_before_the_rename_is_read_under_the_new_name(recorded_as):
    """Records written before the full-scores probe had its name call it "dense" (the seed's
    data/ane-gather-probe.json among them): the headline reads both; a record without it has no ratio."""
    from anelab.publish.headlines import probe_ratio

    rows = [{"graph": recorded_as, "chunk": 32, "x": 4.0}, {"graph": "gather", "chunk": 32, "x": 10.0}]
    assert probe_ratio("x")([{"results": {"rows": rows}}]) == 2.5
    assert gather.probe_graph_name(recorded_as) == gather.FULL_SCORES
    other = [{**rows[0], "graph": "tiled"}, rows[1]]  # negative control: no full-scores row under any name
    assert probe_ratio("x")([{"results": {"rows": other}}]) is None
