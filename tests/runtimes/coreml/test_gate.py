"""The ANE gate: every variant in its own process (load, one predict, compute plan), every failure path
driven through the fake runtime, and through export.

Defects of issue 11 covered here (each test fails on the code at 6b7ba86, as its docstring says):
5 the gate never predicts; 6 only fd 2 captured; 7 E5RT alone too broad; 8 no Neural Engine check.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.runtimes.coreml.coreml_fake import FakeFunction, FakeRuntime
from anelab.runtimes.coreml.coreml_runtime import MacRuntime
from anelab.runtimes.coreml.gate import (
    ANE_REFUSAL_MARKERS,
    VERIFIED_REASON,
    AneGate,
    AneGateError,
    check_merged_loads,
    check_variants,
    find_refusal_markers,
)
from anelab.runtimes.interface import RuntimeUnavailableError
from anelab.sidecar.export import OFF_MAC_REASON, export_layer
from anelab.sidecar.format import read_sidecar_metadata

# Lines as Core ML printed them in the reports each marker cites (abridged paths).
DOCUMENTED_LINES = {
    "ANECCompile() FAILED": (
        "MILCompilerForANE error: failed to compile ANE model using ANEF. Error=_ANECompiler : ANECCompile() FAILED (11)"
    ),
    "MILCompilerForANE error": "E5RT: MILCompilerForANE error: failed to compile ANE model using ANEF.",
    "MILCompileForANE error": "E5RT: MILCompileForANE error: failed to compile ANE model using ANEF.",
    "E5RT with an ANE compiler error": "E5RT encountered an STL exception. msg = _ANECompiler : ANECCompile() FAILED.",
    "ANECF error": "[espresso] [Espresso::handle_ex_plan] exception=ANECF error: failed to load ANE model.",
    "Error plan build": "[coreml] Error plan build: -1.",
    "ANE inference operation failed": "ANE inference operation failed due to unknown error. @ EvaluateANERequest",
    "ANEProgramProcessRequestDirect() Failed": "ANEProgramProcessRequestDirect() Failed with status=0x1 : statusType=0x9",
}
# Core ML chatter that is not a refusal (the cache-miss line is followed by a recompile that succeeds).
BENIGN = (
    "ANE model load has failed for on-device compiled macho. Must re-compile the E5 bundle. @ GetANEFModel\n"
    "Failed to load _MLModelAssetProxy: no module named libcoremlpython\n"
    "compiling model... done\n"
)
# apple/coremltools#2758, verbatim: printed on fd 2 while the load returns normally
MARKER = (
    "E5RT encountered an STL exception. msg = MILCompilerForANE error: failed to compile ANE model using ANEF. "
    "Error=_ANECompiler : ANECCompile() FAILED.\n"
)
# an E5RT line from a non-ANE translation error: not a refusal on its own
E5RT_NOT_ANE = "E5RT encountered an STL exception. msg = failed to translate op 'gather' to the CPU backend.\n"
HEALTHY = {"neural_engine": 64, "gpu": 0, "cpu": 109}  # the seed's healthy range: 64-74 of 173


def _variants(tmp_path: Path, names=("h0", "h4096")) -> dict[str, Path]:
    """Stand-in single-function packages (the fake scripts their behaviour by name)."""
    out = {}
    for name in names:
        pkg = tmp_path / f"{name}.mlpackage"
        pkg.mkdir(parents=True)
        (pkg / "Manifest.json").write_text(f'{{"name": "{name}"}}')
        out[name] = pkg
    return out


def _refused(runtime, variants, match) -> AneGateError:
    with pytest.raises(AneGateError, match=match) as e:
        check_variants(runtime, variants)
    assert "\n" not in str(e.value)
    return e.value


# ---- markers ---------------------------------------------------------------------------------------


def test_every_documented_marker_is_found_in_its_documented_line():
    assert [m.name for m in ANE_REFUSAL_MARKERS] == list(DOCUMENTED_LINES)
    for name, line in DOCUMENTED_LINES.items():
        assert name in find_refusal_markers(line), name
    for marker in ANE_REFUSAL_MARKERS:
        assert marker.source  # every marker says where it is documented


def test_ane_compile_failure_with_a_path_in_the_parentheses_is_found():
    line = "[espresso] exception=ANECF error: ANECCompile(/Library/Caches/com.apple.aned/tmp/x/y/) FAILED: err=("
    assert {"ANECCompile() FAILED", "ANECF error"} <= set(find_refusal_markers(line))


def test_e5rt_without_an_ane_compiler_name_is_not_a_refusal():
    """Defect 7. At 6b7ba86 'E5RT encountered an STL exception' was a marker by itself, so this non-ANE
    translation error was reported as an ANE refusal (the first assertion fails there)."""
    assert find_refusal_markers(E5RT_NOT_ANE) == []
    # control: the same prefix with the ANE compiler named is a refusal
    assert "E5RT with an ANE compiler error" in find_refusal_markers(MARKER)


def test_an_ane_name_on_another_line_does_not_make_an_e5rt_line_a_marker():
    assert find_refusal_markers(E5RT_NOT_ANE + "loading ANEF bundle... ok\n") == []


def test_benign_core_ml_output_has_no_marker():
    assert find_refusal_markers(BENIGN) == []
    assert find_refusal_markers("") == []


# ---- where the messages arrive (each variant runs in a child process) -------------------------------


def test_marker_on_fd2_during_a_normal_load_is_refused_naming_function_and_marker(tmp_path, capfd):
    runtime = FakeRuntime({"h4096": FakeFunction(load_stderr=BENIGN + MARKER, assignment=HEALTHY)})
    err = _refused(runtime, _variants(tmp_path), r"variant h4096 .*fd 2 during load.*ANECCompile\(\) FAILED")
    assert err.function == "h4096" and "MILCompilerForANE error" in str(err)
    assert ["load", str(tmp_path / "h4096.mlpackage"), "h4096", "cpu_and_ne"] in [
        list(c) for c in runtime.child_calls()
    ]  # it loaded normally, in the child
    assert "ANECCompile" not in capfd.readouterr().err  # the text was captured, not passed through


@pytest.mark.parametrize(
    "script, where",
    [
        (FakeFunction(load_stdout=MARKER), "fd 1 during load"),
        (FakeFunction(exit_stderr=MARKER), "at exit"),
        (FakeFunction(log_text="[espresso] exception=ANECF error: failed to load ANE model.\n"), "the unified log"),
        (FakeFunction(predict_stderr="ANE inference operation failed due to unknown error.\n"), "during predict"),
    ],
    ids=["fd1", "only-at-exit", "only-in-the-log", "at-first-predict"],
)
def test_a_marker_wherever_core_ml_puts_it_is_refused_naming_where(tmp_path, script, where):
    """Defects 5 and 6. At 6b7ba86 the gate captured fd 2 during load and the plan only, in-process, and
    never predicted: a marker on fd 1, at process exit, in the unified log or at first inference
    passed, and the export was verified."""
    runtime = FakeRuntime({"h4096": script})
    _refused(runtime, _variants(tmp_path), rf"variant h4096 .*{where}")


def test_same_variants_without_a_marker_pass(tmp_path):
    # negative control for the tests above: only the texts differ (benign chatter on every channel)
    quiet = FakeFunction(load_stdout=BENIGN, exit_stderr=BENIGN, log_text=BENIGN, predict_stderr=E5RT_NOT_ANE)
    evidence = check_variants(FakeRuntime({"h4096": quiet}), _variants(tmp_path))
    assert sorted(evidence) == ["h0", "h4096"] and evidence["h4096"]["predicted"] is True


def test_a_first_predict_that_kills_the_process_is_a_refusal_naming_the_signal(tmp_path):
    """Defects 4 and 5 (apple/coremltools#2758: SIGKILL at the first predict after an ANE compile
    failure). At 6b7ba86 the gate never predicted, so this variant was verified."""
    runtime = FakeRuntime({"h4096": FakeFunction(predict_signal="SIGKILL")})
    _refused(runtime, _variants(tmp_path), r"variant h4096 was killed by SIGKILL during predict")


def test_a_predict_that_raises_is_a_refusal_naming_the_step(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(predict_error="Error computing NN outputs.")})
    _refused(runtime, _variants(tmp_path), r"variant h0 failed at predict .*Error computing NN outputs")


def test_the_gate_predicts_a_stateful_variant_through_its_state(tmp_path):
    """Defect 1 at the gate: the fake refuses a stateful predict without a state, so this passes only
    because the child makes one (``make_state`` + ``predict(..., state=)``)."""
    stateful = FakeFunction(inputs={"hidden": (4, 8), "start": (1,), "mask": (4, 16)}, states={"k_cache": (2, 16)})
    evidence = check_variants(FakeRuntime({"c4": stateful}), _variants(tmp_path, ("c4",)))
    assert evidence["c4"]["predicted"] is True


def test_each_variant_is_compiled_once_and_planned_from_its_compiled_copy(tmp_path):
    """Defect 2 at the gate: at 6b7ba86 each variant was compiled by MLModel(.mlpackage) for the load and
    again by compile_model for the plan. Here: one compile per variant, the load and the plan use it
    (the fake aborts a plan asked of an .mlpackage, as coremltools 9.0 does)."""
    runtime = FakeRuntime()
    variants = _variants(tmp_path)
    check_variants(runtime, variants)
    calls = runtime.child_calls()
    assert [c[1] for c in calls if c[0] == "compile"] == [str(variants["h0"]), str(variants["h4096"])]
    assert [c[0] for c in calls] == ["compile", "load", "predict", "compute_plan"] * 2


# ---- refused up front -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "runtime, match",
    [
        (FakeRuntime(machine="x86_64"), "x86_64, not Apple silicon"),
        (FakeRuntime(neural_engine=False), "lists none"),
    ],
    ids=["intel-mac", "no-ane-listed"],
)
def test_no_neural_engine_is_refused_before_anything_loads(tmp_path, runtime, match):
    """Defect 8. At 6b7ba86 an Intel Mac on macOS 15 passed: nothing asked for a Neural Engine."""
    _refused(runtime, _variants(tmp_path), match)
    assert runtime.calls == [] and runtime.child_calls() == []


def test_mac_runtime_names_a_missing_neural_engine():
    class Devices:
        class models:  # noqa: N801 - mirrors coremltools' module layout
            class compute_device:  # noqa: N801
                class MLNeuralEngineComputeDevice:
                    pass

            class MLModel:
                listed: list = []

                @classmethod
                def get_available_compute_devices(cls):
                    return cls.listed

    mac = dict(platform_name="darwin", macos_version=lambda: (15, 1), import_native=lambda: None, ct=lambda: Devices)
    assert "arm64" in MacRuntime(machine="x86_64", **mac).neural_engine_reason()
    assert "lists none" in MacRuntime(machine="arm64", **mac).neural_engine_reason()
    Devices.models.MLModel.listed = [Devices.models.compute_device.MLNeuralEngineComputeDevice()]
    assert MacRuntime(machine="arm64", **mac).neural_engine_reason() == ""  # control: an ANE is listed


# ---- assignment ---------------------------------------------------------------------------


def test_variant_with_none_of_its_operations_on_the_ane_is_refused_with_counts(tmp_path):
    # the seed's silent case: Qwen 3.8 h12288, 0 of 173 operations on the Neural Engine
    runtime = FakeRuntime({"h4096": FakeFunction(assignment={"neural_engine": 0, "gpu": 0, "cpu": 173})})
    _refused(runtime, _variants(tmp_path), r"variant h4096 has 0 of 173 .*cpu 173")


def test_one_operation_on_the_ane_is_enough_and_nothing_is_not(tmp_path):
    ok = FakeRuntime({"h4096": FakeFunction(assignment={"neural_engine": 1, "gpu": 0, "cpu": 172})})
    assert check_variants(ok, _variants(tmp_path))["h4096"] == {
        "ane_ops": 1,
        "total_ops": 173,
        "stderr_markers": [],
        "predicted": True,
        "log_caveat": "",
    }
    for assignment in (None, {"unreported": 173}):
        runtime = FakeRuntime({"h0": FakeFunction(assignment=assignment)})
        _refused(runtime, _variants(tmp_path / str(id(assignment))), "reports no operation assignments")


def test_a_compute_plan_that_cannot_be_read_is_refused_naming_the_variant(tmp_path):
    runtime = FakeRuntime({"h4096": FakeFunction(plan_error="Failed to build the model execution plan")})
    _refused(runtime, _variants(tmp_path), r"variant h4096 failed at plan .*execution plan")


def test_variant_that_does_not_load_is_refused_naming_it(tmp_path):
    runtime = FakeRuntime({"h4096": FakeFunction(load_error="Failed to build the model execution plan (code 14)")})
    _refused(runtime, _variants(tmp_path), r"variant h4096 does not load .*execution plan")


def test_gate_refuses_an_unavailable_runtime(tmp_path):
    with pytest.raises(RuntimeUnavailableError):
        check_variants(FakeRuntime(available=False, reason="no Core ML here"), _variants(tmp_path))


# ---- after the merge -----------------------------------------------------------------------------------


def test_function_that_does_not_load_after_the_merge_is_refused_naming_it(tmp_path):
    merged = _variants(tmp_path, ("merged",))["merged"]
    runtime = FakeRuntime({"h8192": FakeFunction(load_error="no Core ML model proxy")})
    with pytest.raises(AneGateError) as e:
        check_merged_loads(runtime, merged, ["h0", "h4096", "h8192"])
    assert "function h8192 of the merged package does not load" in str(e.value) and e.value.function == "h8192"
    assert [c[2] for c in runtime.child_calls() if c[0] == "load"] == ["h0", "h4096", "h8192"]
    check_merged_loads(FakeRuntime(), merged, ["h0", "h4096", "h8192"])  # control: all load -> no error


def test_marker_during_a_merged_load_is_refused(tmp_path):
    merged = _variants(tmp_path, ("merged",))["merged"]
    runtime = FakeRuntime({"h4096": FakeFunction(load_stderr="exception=ANECF error: failed to load ANE model\n")})
    with pytest.raises(AneGateError, match=r"function h4096 of the merged package .*load of h4096.*ANECF error") as e:
        check_merged_loads(runtime, merged, ["h0", "h4096", "h8192"])  # named by the text's function, not the last
    assert e.value.function == "h4096"


# ---- through anelab.sidecar.export.export_layer ----------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint("llama"))


def test_export_with_a_healthy_runtime_records_verified_with_evidence(checkpoint, tmp_path):
    runtime = FakeRuntime(
        {
            "h0": FakeFunction(assignment={"neural_engine": 12, "gpu": 0, "cpu": 5}),
            "h4": FakeFunction(assignment={"neural_engine": 10, "gpu": 1, "cpu": 6}),
        }
    )
    result = export_layer(checkpoint, 0, 4, [0, 4], tmp_path / "out", gate=AneGate.for_runtime(runtime))
    meta = read_sidecar_metadata(result.package)  # read back from the saved package
    assert meta.ane_verified is True and meta.ane_reason == VERIFIED_REASON
    assert meta.ane_evidence == {
        "h0": {"ane_ops": 12, "total_ops": 17, "stderr_markers": [], "predicted": True, "log_caveat": ""},
        "h4": {"ane_ops": 10, "total_ops": 17, "stderr_markers": [], "predicted": True, "log_caveat": ""},
    }
    calls = runtime.child_calls()
    # the real variants' specs were read: the zero inputs matched them (the fake refuses any mismatch)
    assert [c[2] for c in calls if c[0] == "predict"] == ["h0", "h4", "h0", "h4"]  # the variants, then the merge's
    merged_loads = [c for c in calls if c[0] == "load" and Path(c[1]).name == "merged.mlpackage"]
    assert [c[2] for c in merged_loads] == ["h0", "h4"]
    first_merged = calls.index(merged_loads[0])
    plans = [c for c in calls if c[0] == "compute_plan"]
    assert len(plans) == 2  # one compute plan per variant, every one before the merged package loads
    assert all(calls.index(c) < first_merged for c in plans)


def test_export_refused_by_the_gate_leaves_no_package(checkpoint, tmp_path):
    out = tmp_path / "out"
    runtime = FakeRuntime({"h4": FakeFunction(load_stderr=MARKER)})
    with pytest.raises(AneGateError, match=r"variant h4 .*ANECCompile\(\) FAILED"):
        export_layer(checkpoint, 0, 4, [0, 4], out, gate=AneGate.for_runtime(runtime))
    assert list(out.iterdir()) == []  # no package, no half-written temporary directory


@pytest.mark.parametrize(
    "runtime",
    [None, FakeRuntime(available=False), MacRuntime(platform_name="linux")],
    ids=["no-runtime", "unavailable-fake", "mac-runtime-off-mac"],
)
def test_export_without_the_runtime_records_not_verified_with_the_reason(checkpoint, tmp_path, runtime):
    result = export_layer(checkpoint, 0, 4, [0, 4], tmp_path / "out", gate=AneGate.for_runtime(runtime))
    meta = read_sidecar_metadata(result.package)
    assert meta.ane_verified is False and meta.ane_reason == OFF_MAC_REASON and meta.ane_evidence == {}
    if isinstance(runtime, FakeRuntime):
        assert runtime.calls == []  # nothing was loaded or asked


def test_a_child_process_end_is_described_in_words():
    from anelab.runtimes.interface import CHILD_TIMED_OUT, describe_child_exit

    assert describe_child_exit(CHILD_TIMED_OUT, "did not finish within 5 s") == "did not finish within 5 s"
    assert describe_child_exit(-9) == "was killed by SIGKILL"
    assert describe_child_exit(-200) == "was killed by signal 200"
    assert describe_child_exit(3) == "exited with status 3"
