"""The fake behaves like Core ML through coremltools 9.0 (defect 9 of issue 11: a kinder fake hid 1-8).

At 6b7ba86 the fake had: a warm cache keyed by the package path, free compiles and teardown,
stderr only on fd 2 and instantly, a predict that never failed and never needed a state, and a
compute plan that accepted any path. Every test below fails there (no compile cost, no teardown,
no state, no fd 1 / exit / log messages, predict never raises).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from anelab.core.paths import REPO_ROOT
from anelab.runtimes.coreml.coreml_fake import FakeCrash, FakeFunction, FakeRuntime
from anelab.runtimes.interface import RuntimePredictError, capture_native_output, prepare_inputs

SIGNATURE = dict(inputs={"hidden": (4, 8), "mask": (4, 4)}, output_shapes={"attn_out": (4, 8)})
STATEFUL = dict(inputs={"hidden": (4, 8), "start": (1,), "mask": (4, 16)}, states={"k_cache": (2, 16)})


def _package(tmp_path: Path, name: str = "h0.mlpackage") -> Path:
    pkg = tmp_path / name
    pkg.mkdir(parents=True)
    (pkg / "Manifest.json").write_text("{}")
    return pkg


def _inputs(**shapes) -> dict:
    return {k: np.zeros(s, np.float32) for k, s in shapes.items()}


# ---- loading ---------------------------------------------------------------------------------------


def test_loading_an_mlpackage_compiles_it_every_time_into_a_temporary_copy(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(cold_load_s=6.0, warm_load_s=1.0, teardown_s=0.0)})
    pkg = _package(tmp_path)
    runtime.prepare_process()  # the process's one-time import and sw_vers, before the clock
    start = runtime.clock()
    first = runtime.load_path(pkg, None, "cpu_and_ne")
    second = runtime.load_path(pkg, None, "cpu_and_ne")
    # compile 4 s + a cold load 6 s, twice: a fresh compiled path is never warm
    assert runtime.clock() - start == pytest.approx(2 * (4.0 + 6.0))
    assert first.compiled != second.compiled and first.compiled.suffix == ".mlmodelc"
    copy = first.compiled
    del first
    assert not copy.exists()  # deleted with its handle, as the native destructor does


def test_the_runtime_compiles_once_and_the_second_load_of_the_compiled_copy_is_warm(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(cold_load_s=6.0, warm_load_s=1.0, teardown_s=0.0)})
    pkg = _package(tmp_path)
    runtime.prepare_process()
    start = runtime.clock()
    runtime.load(pkg, None, "cpu_only")  # (under cpu_and_ne a pre-flight child would compile it first)
    runtime.load(pkg, None, "cpu_only")
    assert runtime.clock() - start == pytest.approx(4.0 + 6.0 + 1.0)
    assert runtime.compiles == [str(pkg)]
    (pkg / "Manifest.json").write_text('{"changed": true}')  # new content: a new compiled copy
    runtime.load(pkg, None, "cpu_only")
    assert runtime.compiles == [str(pkg)] * 2


def test_releasing_a_handle_costs_its_teardown(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(teardown_s=0.2)})
    handle = runtime.load(_package(tmp_path), None, "cpu_only")
    before = runtime.clock()
    del handle
    assert runtime.clock() - before == pytest.approx(0.2) and runtime.released == ["h0"]


# ---- predict ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "inputs, match",
    [
        (_inputs(hidden=(4, 8)), "Feature mask is required but not specified"),
        (_inputs(hidden=(4, 8), mask=(4, 5)), "the provided shape \\(4, 5\\) is not compatible"),
    ],
    ids=["missing", "wrong-shape"],
)
def test_predict_fails_like_core_ml(tmp_path, inputs, match):
    runtime = FakeRuntime({"h0": FakeFunction(**SIGNATURE)})
    handle = runtime.load(_package(tmp_path), None, "cpu_only")
    with pytest.raises(RuntimePredictError, match=match):
        runtime.predict(handle, inputs)
    # control: the inputs the function declares
    assert runtime.predict(handle, _inputs(hidden=(4, 8), mask=(4, 4)))["attn_out"].shape == (4, 8)


def test_a_stateful_function_without_a_state_fails_and_with_one_runs(tmp_path):
    runtime = FakeRuntime({"c4": FakeFunction(**STATEFUL)})
    handle = runtime.load(_package(tmp_path, "c4.mlpackage"), None, "cpu_and_ne")
    inputs = _inputs(hidden=(4, 8), start=(1,), mask=(4, 16))
    with pytest.raises(RuntimePredictError, match="k_cache must be an MLState"):  # apple/coremltools#2519
        runtime.predict(handle, inputs)
    state = runtime.make_state(handle)
    assert set(state) == {"k_cache"}
    runtime.predict(handle, inputs, state=state)


def test_fp16_inputs_are_cast_in_the_callers_dict_and_cost_time(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(convert_s=0.05, predict_default_s=0.5, **SIGNATURE)})
    handle = runtime.load(_package(tmp_path), None, "cpu_only")
    inputs = {"hidden": np.zeros((4, 8), np.float16), "mask": np.zeros((4, 4), np.float16)}
    before = runtime.clock()
    runtime.predict(handle, inputs)
    # input cast 0.05 + Core ML 0.5 + outputs to NumPy 0.02 (default output_convert_s)
    assert runtime.clock() - before == pytest.approx(0.57) and runtime.predict_duration_s(handle) == 0.5
    assert inputs["hidden"].dtype == np.float32  # coremltools mutates the caller's dict
    # prepare_inputs converts once, into a new dict: predict then costs the prediction only
    given = {"hidden": np.zeros((4, 8), np.float16), "mask": np.zeros((4, 4), np.float16)}
    ready = prepare_inputs(given)
    before = runtime.clock()
    runtime.predict(handle, ready)
    assert runtime.clock() - before == pytest.approx(0.52) and given["hidden"].dtype == np.float16


# ---- messages --------------------------------------------------------------------------------------


def test_messages_arrive_on_fd1_fd2_and_the_log_not_on_sys_streams(tmp_path):
    script = FakeFunction(load_stdout="on fd 1\n", load_stderr="on fd 2\n", log_text="[coreml] only in the log\n")
    runtime = FakeRuntime({"h0": script})
    start = time.time()
    with capture_native_output() as out:
        runtime.load(_package(tmp_path), None, "cpu_and_ne")
    assert out.stdout == "on fd 1\n" and out.stderr == "on fd 2\n"
    assert "only in the log" in runtime.read_unified_log(os.getpid(), start, time.time())
    assert "only in the log" not in out.text


def test_a_message_printed_only_at_exit_is_not_seen_during_the_load(tmp_path):
    code = (
        "import sys; from pathlib import Path\n"
        "from anelab.runtimes.coreml.coreml_fake import FakeFunction, FakeRuntime\n"
        "from anelab.runtimes.interface import capture_native_output\n"
        f"rt = FakeRuntime({{'h0': FakeFunction(exit_stderr='ANECCompile() FAILED at exit\\n')}})\n"
        "with capture_native_output() as out:\n"
        f"    rt.load_path(rt.compile(Path({str(_package(tmp_path))!r})), None, 'cpu_and_ne')\n"
        "print('during load:', repr(out.stderr))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert "during load: ''" in done.stdout  # nothing while loading ...
    assert "ANECCompile() FAILED at exit" in done.stderr  # ... the message came at exit


# ---- compute plan and crashes -------------------------------------------------------------------------


def test_the_compute_plan_needs_a_compiled_copy(tmp_path):
    runtime = FakeRuntime()
    pkg = _package(tmp_path)
    with pytest.raises(FakeCrash, match="SIGABRT"):  # apple/coremltools#2757: an .mlpackage aborts the process
        runtime.plan_path(pkg, "cpu_and_ne")
    assert runtime.compute_plan_assignment(pkg, "cpu_and_ne")["neural_engine"] == 64  # via the compiled copy


def test_a_scripted_predict_signal_is_not_an_exception(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(predict_signal="SIGKILL", **SIGNATURE)})
    handle = runtime.load_path(runtime.compile(_package(tmp_path)), None, "cpu_and_ne")  # no pre-flight: raw
    with pytest.raises(FakeCrash) as e:
        try:
            runtime.predict(handle, _inputs(hidden=(4, 8), mask=(4, 4)))
        except Exception:  # what a caller's error handling would do: it cannot catch a signal
            pytest.fail("a crash must not be catchable as an Exception")
    assert e.value.signal_name == "SIGKILL"


def test_the_fakes_own_temporary_folder_goes_with_it_and_a_given_one_stays(tmp_path):
    """Core ML deletes a temporary compiled model with its handle; the fake's own folder (compiled copies,
    logs) is removed with the runtime, while a folder the caller passed is the caller's (control)."""
    import gc

    from anelab.runtimes.coreml.coreml_fake import FakeRuntime

    runtime = FakeRuntime()
    runtime.cache_dir.mkdir(parents=True)
    own = runtime.cache_dir.parent
    given = FakeRuntime(cache_dir=tmp_path / "cache", log_dir=tmp_path / "log")
    given.cache_dir.mkdir()
    del runtime, given
    gc.collect()
    assert not own.exists() and (tmp_path / "cache").is_dir()
