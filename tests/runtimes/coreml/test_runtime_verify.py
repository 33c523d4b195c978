"""``anelab verify --compute-units``: every case through Core ML predict (here: the fake, computing the
saved program as Core ML would), three comparisons per output; off-Mac one line and exit 2."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import as_gate_passed

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.runtimes.coreml.coreml_fake import FakeRuntime
from anelab.runtimes.coreml.device_verify import verify_on_device
from anelab.sidecar.export import export_layer


@pytest.fixture(scope="module")
def sidecar(tiny_checkpoint, tmp_path_factory):
    ckpt = tiny_checkpoint("llama")
    out = tmp_path_factory.mktemp("verify-device")
    return as_gate_passed(export_layer(load_checkpoint(ckpt), 0, 8, [0, 8], out).package), ckpt


def test_off_mac_the_flag_exits_2_with_one_line(sidecar, capsys):
    pkg, _ = sidecar
    assert main(["verify", str(pkg), "--compute-units", "cpu_and_ne"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Core ML runtime is unavailable" in err and "macOS 15+" in err


def test_unknown_compute_units_are_refused(sidecar):
    pkg, ckpt = sidecar
    with pytest.raises(AnelabInputError, match="unknown compute units"):
        verify_on_device(pkg, load_checkpoint(ckpt), compute_units="neural_engine", runtime=FakeRuntime(numerics=True))


def test_every_case_runs_through_predict_with_three_comparisons(sidecar):
    pkg, ckpt = sidecar
    runtime = FakeRuntime(numerics=True)
    report = verify_on_device(pkg, load_checkpoint(ckpt), compute_units="cpu_and_ne", runtime=runtime)
    assert report.passed and "Core ML predict (cpu_and_ne" in report.evaluator, report.table()
    cases = [(c.function, c.case) for c in report.comparisons]
    for fn in ("h0", "h8"):
        assert (fn, "full chunk") in cases  # device vs reference
        assert (fn, "full chunk: device vs NumPy") in cases and (fn, "full chunk: NumPy vs ref.") in cases
        assert (fn, "partial (5 of 8): device vs NumPy") in cases
        assert (fn, "control: mask reaches graph") in cases
    predicts = [c for c in runtime.calls if c[0] == "predict"]
    # per function: full, partial, the dropped-mask control
    assert [c[2] for c in predicts] == ["h0"] * 3 + ["h8"] * 3
    compiled = runtime.compiles + [c[1] for c in runtime.child_calls() if c[0] == "compile"]
    assert {c[3] for c in predicts} == {"cpu_and_ne"} and len(compiled) == 1  # once, in the first pre-flight child


def test_a_device_that_computes_something_else_fails_against_both(sidecar):
    # negative control: the "device" returns zeros (the fake without numerics)
    pkg, ckpt = sidecar
    report = verify_on_device(pkg, load_checkpoint(ckpt), compute_units="cpu_and_ne", runtime=FakeRuntime())
    assert not report.passed
    by_case = {(c.function, c.case): c for c in report.comparisons}
    assert not by_case[("h8", "full chunk")].passed
    assert not by_case[("h8", "full chunk: device vs NumPy")].passed
    assert by_case[("h8", "full chunk: NumPy vs ref.")].passed  # the package itself is right


@pytest.fixture(scope="module")
def stateful(tiny_checkpoint, tmp_path_factory):
    ckpt = tiny_checkpoint("llama")
    out = tmp_path_factory.mktemp("verify-device-stateful")
    pkg = export_layer(load_checkpoint(ckpt), 0, 4, None, out, graph="stateful", capacity=16, decode=True).package
    return as_gate_passed(pkg), ckpt


def test_a_stateful_sidecar_verifies_on_the_device_through_its_state(stateful):
    pkg, ckpt = stateful
    runtime = FakeRuntime(numerics=True)
    report = verify_on_device(pkg, load_checkpoint(ckpt), compute_units="cpu_and_ne", runtime=runtime)
    assert report.passed, report.table()
    cases = [c.case for c in report.comparisons]
    assert "device vs NumPy" in cases and "NumPy vs ref." in cases and "control: state carried" in cases
    predicts = [c for c in runtime.calls if c[0] == "predict"]
    assert {c[2] for c in predicts} == {"c4", "c1"}  # the fake refuses any of them without a state


def test_a_device_that_drops_the_state_fails_the_stateful_check(stateful):
    # negative control: a device whose state never carries over (a fresh state at every call)
    pkg, ckpt = stateful
    runtime = FakeRuntime(numerics=True)
    real = runtime.predict
    runtime.predict = lambda handle, inputs, state=None: real(handle, inputs, state=runtime.make_state(handle))
    report = verify_on_device(pkg, load_checkpoint(ckpt), compute_units="cpu_and_ne", runtime=runtime)
    by_case = {c.case: c for c in report.comparisons}
    assert not report.passed and not by_case["device vs NumPy"].passed and by_case["NumPy vs ref."].passed


def test_the_device_cache_is_read_back_and_checked(stateful):
    """The caches the device's state holds are compared too (MLState.read_state): a device whose
    attention is right but whose state ends empty fails on k_chunk/v_chunk."""
    pkg, ckpt = stateful
    runtime = FakeRuntime(numerics=True)
    report = verify_on_device(pkg, load_checkpoint(ckpt), compute_units="cpu_and_ne", runtime=runtime)
    first = report.comparisons[0]
    assert first.passed and {"attn_out", "k_chunk", "v_chunk"} <= set(first.errors)
    real_make_state = runtime.make_state

    def make_state(handle):  # a state that forgets what was written to it when read back
        state = real_make_state(handle)
        state.read_state = lambda name: np.zeros_like(state[name], dtype=np.float32)
        return state

    runtime.make_state = make_state
    report = verify_on_device(pkg, load_checkpoint(ckpt), compute_units="cpu_and_ne", runtime=runtime)
    first = report.comparisons[0]
    assert not report.passed and first.errors["attn_out"] < 1e-2 and first.errors["k_chunk"] == 1.0


def test_the_fold_check_runs_on_the_device_too(tiny_checkpoint, tmp_path):
    """A package recording the fold contract: its fold rows are the device's (predict calls under the
    folded and the causal-only mask), and a device that ignores its mask fails the fold row."""
    ckpt = tiny_checkpoint("qwen3")
    pkg = as_gate_passed(
        export_layer(
            load_checkpoint(ckpt), 0, 32, [0, 32], tmp_path, selection={"kept_blocks": 2, "compress_ratio": 4}
        ).package
    )
    runtime = FakeRuntime(numerics=True)
    report = verify_on_device(pkg, load_checkpoint(ckpt), compute_units="cpu_and_ne", runtime=runtime)
    fold_rows = [c for c in report.comparisons if c.case.startswith("fold:") or c.case == "control: causal-only mask"]
    assert report.passed and len(fold_rows) == 2, report.table()
    fold_predicts = [c for c in runtime.calls if c[0] == "predict" and c[2] == "h32"]
    assert len(fold_predicts) == 3 + 2  # full, partial, dropped-mask control; then folded and causal-only
    real = runtime.predict

    def causal_only(handle, inputs, state=None):  # a device whose graph ignores the folded selection
        from anelab.core.masks import causal

        if handle.function == "h32":
            inputs = {**inputs, "mask": causal(32, 32).astype(np.float16)}
        return real(handle, inputs, state=state)

    runtime.predict = causal_only
    report = verify_on_device(pkg, load_checkpoint(ckpt), compute_units="cpu_and_ne", runtime=runtime)
    fold = next(c for c in report.comparisons if c.case.startswith("fold:"))
    assert not fold.passed and not report.passed
