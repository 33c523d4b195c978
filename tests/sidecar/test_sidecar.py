"""Use-time refusals: every one happens before the runtime loads anything."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import chunk_starts
from anelab.core.selection import Selection
from anelab.runtimes.coreml.coreml_fake import FakeRuntime
from anelab.runtimes.interface import RuntimePredictError, RuntimeUnavailableError, zero_inputs
from anelab.runtimes.open import open_sidecar
from anelab.sidecar.export import export_layer
from anelab.sidecar.format import read_sidecar_metadata, write_package_metadata

CHUNK = 4
HISTORIES = [0, 4, 8]  # coverage 8 + 4 = 12 tokens
# kept_blocks 2, compress_ratio 2: a row keeps every key while it sees <= 2*2 + (2-1) = 5 keys
INDEXER = {"indexer": "qsa_block_topk", "kept_blocks": 2, "compress_ratio": 2}
WINDOW = 5


@pytest.fixture(scope="module")
def packages(tiny_checkpoint, tmp_path_factory):
    """Sidecars with the same graph and different metadata: name -> package path."""
    root = tmp_path_factory.mktemp("sidecars")
    checkpoint = load_checkpoint(tiny_checkpoint("llama"))
    base = export_layer(checkpoint, 0, CHUNK, HISTORIES, root / "base").package
    gap = export_layer(checkpoint, 0, CHUNK, [0, 8], root / "gap").package
    meta = read_sidecar_metadata(base)
    evidence = {f"h{h}": {"ane_ops": 12, "total_ops": 17, "stderr_markers": []} for h in HISTORIES}
    verified = dict(ane_verified=True, ane_reason="verified (test)", ane_evidence=evidence)
    out = {"unverified": base}
    for name, changes in {
        "verified": verified,
        "sparse_unfolded": {**verified, "selection_indexer": INDEXER},
        "sparse_folded": {**verified, "selection_folded": True, "selection_indexer": INDEXER},
        "folded_no_indexer": {**verified, "selection_folded": True, "selection_indexer": None},
    }.items():
        dest = root / name / "layer_0.mlpackage"
        dest.parent.mkdir()
        write_package_metadata(base, dest, dataclasses.replace(meta, **changes).to_strings())
        out[name] = dest
    gap_meta = read_sidecar_metadata(gap)
    dest = root / "gap_verified" / "layer_0.mlpackage"
    dest.parent.mkdir()
    write_package_metadata(gap, dest, dataclasses.replace(gap_meta, **verified).to_strings())
    out["gap"] = dest
    return out


def _refused(runtime: FakeRuntime, match: str, pkg: Path, **kwargs) -> str:
    with pytest.raises(AnelabInputError, match=match) as e:
        open_sidecar(pkg, runtime=runtime, **kwargs)
    assert runtime.calls == []  # refused before anything was loaded
    assert "\n" not in str(e.value)
    return str(e.value)


# ---- the Neural Engine needs a verified package ----------------------------------------------------


@pytest.mark.parametrize("units", ["cpu_and_ne", "all"])
def test_unverified_package_is_refused_for_the_neural_engine(packages, units):
    message = _refused(FakeRuntime(), "aneCompileVerified", packages["unverified"], compute_units=units, chunk=CHUNK)
    assert "not verified" in message and "cpu_and_gpu" in message


@pytest.mark.parametrize("units", ["cpu_only", "cpu_and_gpu"])
def test_unverified_package_opens_without_the_neural_engine(packages, units):
    sidecar = open_sidecar(packages["unverified"], compute_units=units, chunk=CHUNK, runtime=FakeRuntime())
    assert sidecar.compute_units == units


def test_verified_package_opens_for_the_neural_engine(packages):
    runtime = FakeRuntime()
    sidecar = open_sidecar(packages["verified"], compute_units="cpu_and_ne", chunk=CHUNK, runtime=runtime)
    assert sidecar.metadata.ane_verified and sidecar.coverage == 12 and runtime.calls == []


# ---- chunk width and coverage ------------------------------------------------------------------------


def test_different_chunk_width_is_refused_naming_both(packages):
    message = _refused(FakeRuntime(), "chunk", packages["verified"], compute_units="cpu_and_ne", chunk=8)
    assert "8" in message and "width is 4" in message


def test_prompt_beyond_coverage_is_refused_naming_coverage_and_need(packages):
    # 13 tokens: chunks start at 0, 4, 8, 12 -> history 12 needed, coverage 16; the package covers 12
    message = _refused(
        FakeRuntime(),
        "covers 12 tokens",
        packages["verified"],
        compute_units="cpu_and_ne",
        chunk=CHUNK,
        prompt_tokens=13,
    )
    assert "histories up to 12" in message and "coverage 16" in message and "missing 12" in message


def test_prompt_at_coverage_is_served(packages):
    # boundary control for the refusal above: 12 tokens fit exactly
    runtime = FakeRuntime()
    sidecar = open_sidecar(
        packages["verified"], compute_units="cpu_and_ne", chunk=CHUNK, prompt_tokens=12, runtime=runtime
    )
    assert [sidecar.function_for(s) for s in chunk_starts(12, CHUNK)] == ["h0", "h4", "h8"]
    assert runtime.calls == []


def test_missing_history_inside_coverage_is_refused(packages):
    # histories 0,8: coverage 12, but a 6-token prompt's second chunk needs h4
    _refused(FakeRuntime(), "missing 4", packages["gap"], compute_units="cpu_and_ne", chunk=CHUNK, prompt_tokens=6)


def test_chunk_starts_are_hand_checked():
    assert chunk_starts(1, 4) == [0]
    assert chunk_starts(4, 4) == [0]
    assert chunk_starts(5, 4) == [0, 4]
    assert chunk_starts(4333, 4096) == [0, 4096]
    with pytest.raises(AnelabInputError):
        chunk_starts(0, 4)


# ---- sparse-indexed models ---------------------------------------------------------------------------


def test_sparse_model_without_the_fold_contract_is_refused(packages):
    message = _refused(
        FakeRuntime(),
        "selectionFolded",
        packages["sparse_unfolded"],
        compute_units="cpu_and_ne",
        chunk=CHUNK,
        sparse_indexed=True,
    )
    assert "sparse-indexed" in message


def test_dense_model_does_not_need_the_fold_contract(packages):
    # control: the same package opens when the model is not sparse-indexed
    open_sidecar(packages["sparse_unfolded"], compute_units="cpu_and_ne", chunk=CHUNK, runtime=FakeRuntime())


def test_folded_package_without_indexer_parameters_is_refused(packages):
    _refused(
        FakeRuntime(),
        "kept_blocks",
        packages["folded_no_indexer"],
        compute_units="cpu_and_ne",
        chunk=CHUNK,
        sparse_indexed=True,
    )


def test_chunk_past_the_dense_exact_window_without_a_selection_refuses_to_attend_densely(packages):
    message = _refused(
        FakeRuntime(),
        "refusing to attend densely",
        packages["sparse_folded"],
        compute_units="cpu_and_ne",
        chunk=CHUNK,
        sparse_indexed=True,
        prompt_tokens=WINDOW + 1,
    )
    assert f"window of {WINDOW}" in message and f"up to {WINDOW + 1} keys" in message


def test_prompt_inside_the_dense_exact_window_attends_densely(packages):
    # 5 tokens: the last row sees 5 keys = the window, where the causal mask equals the selection
    sidecar = open_sidecar(
        packages["sparse_folded"],
        compute_units="cpu_and_ne",
        chunk=CHUNK,
        sparse_indexed=True,
        prompt_tokens=WINDOW,
        runtime=FakeRuntime(),
    )
    assert sidecar.dense_exact_window == WINDOW
    assert sidecar.function_for(4, valid_rows=1) == "h4"
    with pytest.raises(AnelabInputError, match="refusing to attend densely"):
        sidecar.function_for(4, valid_rows=2)  # 6 keys
    assert sidecar.function_for(0) == "h0"  # a full first chunk: rows see at most 4 keys
    with pytest.raises(AnelabInputError, match="up to 8 keys"):
        sidecar.function_for(4)  # a full second chunk: the last row sees 8 keys


def _selection(kept_blocks: int) -> Selection:
    rows = CHUNK
    keep = np.zeros((rows, 2), dtype=np.int32)
    return Selection(
        keep_indices=keep, keep_counts=np.ones(rows, dtype=np.int32), kept_blocks=kept_blocks, compress_ratio=2, start=8
    )


def test_a_selection_lets_chunks_past_the_window_run(packages):
    runtime = FakeRuntime()
    sidecar = open_sidecar(
        packages["sparse_folded"],
        compute_units="cpu_and_ne",
        chunk=CHUNK,
        sparse_indexed=True,
        prompt_tokens=12,
        selection=_selection(2),
        runtime=runtime,
    )
    assert sidecar.function_for(8) == "h8" and runtime.calls == []


def test_a_selection_from_another_indexer_is_refused(packages):
    _refused(
        FakeRuntime(),
        "kept_blocks is 3",
        packages["sparse_folded"],
        compute_units="cpu_and_ne",
        chunk=CHUNK,
        sparse_indexed=True,
        selection=_selection(3),
    )


# ---- lazy loading ------------------------------------------------------------------------------------


def test_functions_load_lazily_once_each(packages):
    runtime = FakeRuntime()
    pkg = packages["verified"]
    sidecar = open_sidecar(pkg, compute_units="cpu_and_ne", chunk=CHUNK, runtime=runtime)
    assert sidecar.function_for(8) == "h8" and runtime.loads == []
    first = sidecar.handle_for(8)
    assert sidecar.handle_for(8) is first
    out = sidecar.predict(0, zero_inputs(runtime.signature(pkg, "h0")))
    assert set(out) == {"attn_out", "k_chunk", "v_chunk"}
    assert runtime.loads == [(str(pkg), "h8", "cpu_and_ne"), (str(pkg), "h0", "cpu_and_ne")]
    assert sidecar.loaded == ["h8", "h0"]
    compiled = runtime.compiles + [c[1] for c in runtime.child_calls() if c[0] == "compile"]
    assert compiled == [str(pkg)]  # once (by the first pre-flight child): both functions load from that copy
    assert [c[2] for c in runtime.child_calls() if c[0] == "predict"] == ["h8", "h0"]  # each survived a child first
    with pytest.raises(RuntimePredictError, match="Feature hidden is required"):  # the fake is not kinder
        sidecar.predict(0, {})


@pytest.mark.parametrize("start, match", [(12, "needs history 12"), (3, "not a multiple"), (-4, "not a multiple")])
def test_a_start_the_package_cannot_serve_is_refused_before_loading(packages, start, match):
    runtime = FakeRuntime()
    sidecar = open_sidecar(packages["verified"], compute_units="cpu_and_ne", chunk=CHUNK, runtime=runtime)
    with pytest.raises(AnelabInputError, match=match):
        sidecar.handle_for(start)
    assert runtime.calls == []


# ---- bad input ---------------------------------------------------------------------------------------


def test_unknown_compute_units_is_refused(packages):
    _refused(FakeRuntime(), "cpu_and_ne", packages["verified"], compute_units="neural_engine", chunk=CHUNK)


def test_package_without_sidecar_metadata_is_refused(packages, tmp_path):
    meta = read_sidecar_metadata(packages["verified"]).to_strings()
    dest = tmp_path / "layer_0.mlpackage"
    del meta["aneCompileVerified"]
    import coremltools as ct

    model = ct.models.MLModel(str(packages["verified"]), skip_model_load=True)
    model.user_defined_metadata.clear()
    model.user_defined_metadata.update(meta)
    model.save(str(dest))
    _refused(FakeRuntime(), "lacks 'aneCompileVerified'", dest, compute_units="cpu_only", chunk=CHUNK)


def test_path_that_is_not_a_package_is_refused(tmp_path):
    _refused(FakeRuntime(), "no such package", tmp_path / "missing.mlpackage", compute_units="cpu_only", chunk=CHUNK)


def test_unavailable_runtime_is_refused_after_the_metadata_checks(packages):
    runtime = FakeRuntime(available=False, reason="the Core ML runtime is unavailable (test)")
    with pytest.raises(RuntimeUnavailableError, match="unavailable"):
        open_sidecar(packages["verified"], compute_units="cpu_and_ne", chunk=CHUNK, runtime=runtime)
    # a metadata refusal still comes first, so it can be read off-Mac
    _refused(runtime, "aneCompileVerified", packages["unverified"], compute_units="cpu_and_ne", chunk=CHUNK)
    assert runtime.calls == []


def test_a_weight_the_functions_share_is_converted_once(tmp_path, tiny_checkpoint, monkeypatch):
    """The saved package stores the projections once for all its functions; read back, each function has
    its own const of them: their float32 values are one array (cached by content), while consts whose
    values differ between functions (the RoPE tables of h0 and h4) keep their own (control)."""
    from anelab.sidecar.export import export_sidecars
    from anelab.sidecar.mil import evaluate as evaluate_module
    from anelab.sidecar.mil.evaluate import SavedPackage

    monkeypatch.setattr(evaluate_module, "SHARED_CONST_ELEMENTS", 16)  # the tiny model's weights are small
    [result] = export_sidecars(load_checkpoint(tiny_checkpoint("llama")), tmp_path, 4, [0, 4], [0], jobs=1)
    saved = SavedPackage(result.package)

    def consts(name):
        ops = saved.mil_function(name).operations
        return [op.outputs[0] for op in ops if op.op_type == "const" and np.asarray(op.outputs[0].val).size >= 16]

    h0, h4 = consts("h0"), consts("h4")
    shared = same_values = differ = 0
    for a in h0:
        for b in h4:
            va, vb = np.asarray(a.val), np.asarray(b.val)
            if va.shape != vb.shape or va.dtype != vb.dtype:
                continue
            if np.array_equal(va, vb):
                same_values += 1
                shared += saved.const_value(a) is saved.const_value(b)
            else:
                differ += 1
                assert saved.const_value(a) is not saved.const_value(b)
                assert np.array_equal(saved.const_value(b), vb.astype(saved.const_value(b).dtype))
    assert same_values >= 4 and shared == same_values  # q, k, v, o at least
    assert differ >= 1
