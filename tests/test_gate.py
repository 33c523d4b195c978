"""The three-layer ANE gate, every failure path driven through the fake runtime, and through export."""

from __future__ import annotations

from pathlib import Path

import pytest

from anelab.hf.checkpoint import load_checkpoint
from anelab.runtime.fake import FakeFunction, FakeRuntime
from anelab.runtime.gate import (
    ANE_REFUSAL_MARKERS,
    VERIFIED_REASON,
    AneGate,
    AneGateError,
    check_merged_loads,
    check_variants,
    find_refusal_markers,
)
from anelab.runtime.interface import RuntimeUnavailableError
from anelab.runtime.mac import MacRuntime
from anelab.sidecar.export import OFF_MAC_REASON, export_layer
from anelab.sidecar.format import read_sidecar_metadata

# Lines as Core ML printed them in the reports each marker cites (abridged paths).
DOCUMENTED_LINES = {
    "ANECCompile() FAILED": (
        "MILCompilerForANE error: failed to compile ANE model using ANEF. Error=_ANECompiler : ANECCompile() FAILED (11)"
    ),
    "MILCompilerForANE error": "E5RT: MILCompilerForANE error: failed to compile ANE model using ANEF.",
    "MILCompileForANE error": "E5RT: MILCompileForANE error: failed to compile ANE model using ANEF.",
    "E5RT encountered an STL exception": "E5RT encountered an STL exception. msg = something else",
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
MARKER = (
    "E5RT encountered an STL exception. msg = MILCompilerForANE error: failed to compile ANE model using ANEF. "
    "Error=_ANECompiler : ANECCompile() FAILED.\n"
)
HEALTHY = {"neural_engine": 64, "gpu": 0, "cpu": 109}  # the seed's healthy range: 64-74 of 173


def _variants(tmp_path: Path, names=("h0", "h4096", "h8192")) -> dict[str, Path]:
    out = {}
    for name in names:
        pkg = tmp_path / f"{name}.mlpackage"
        pkg.mkdir()
        out[name] = pkg
    return out


# ---- markers ---------------------------------------------------------------------------------------


def test_every_documented_marker_is_found_in_its_documented_line():
    assert [m.name for m in ANE_REFUSAL_MARKERS] == list(DOCUMENTED_LINES)
    for name, line in DOCUMENTED_LINES.items():
        assert name in find_refusal_markers(line), name
    for marker in ANE_REFUSAL_MARKERS:
        assert marker.source  # every marker says where it is documented


def test_ane_compile_failure_with_a_path_in_the_parentheses_is_found():
    line = "exception=ANECF error: ANECCompile(/Library/Caches/com.apple.aned/tmp/x/ABC/) FAILED: err=("
    assert find_refusal_markers(line) == ["ANECCompile() FAILED", "ANECF error"]


def test_benign_core_ml_output_has_no_marker():
    assert find_refusal_markers(BENIGN) == []
    assert find_refusal_markers("") == []


# ---- layer 1: compile markers ----------------------------------------------------------------------


def test_marker_on_stderr_with_a_normal_load_is_refused_naming_function_and_marker(tmp_path, capfd):
    runtime = FakeRuntime({"h4096": FakeFunction(load_stderr=BENIGN + MARKER, assignment=HEALTHY)})
    with pytest.raises(AneGateError) as e:
        check_variants(runtime, _variants(tmp_path))
    message = str(e.value)
    assert "variant h4096" in message and "ANECCompile() FAILED" in message and "MILCompilerForANE error" in message
    assert "\n" not in message and e.value.function == "h4096"
    assert ("load", str(tmp_path / "h4096.mlpackage"), "h4096", "cpu_and_ne") in runtime.calls  # it loaded normally
    assert "ANECCompile" not in capfd.readouterr().err  # the text went through the fd-level capture


def test_same_variants_without_the_marker_pass(tmp_path):
    # negative control for the test above: only the stderr text differs
    runtime = FakeRuntime({"h4096": FakeFunction(load_stderr=BENIGN, assignment=HEALTHY)})
    evidence = check_variants(runtime, _variants(tmp_path))
    assert sorted(evidence) == ["h0", "h4096", "h8192"]


def test_marker_printed_while_the_compute_plan_is_built_is_refused_too(tmp_path):
    runtime = FakeRuntime({"h8192": FakeFunction(plan_stderr="[coreml] Error plan build: -1.\n")})
    with pytest.raises(AneGateError, match=r"variant h8192.*Error plan build"):
        check_variants(runtime, _variants(tmp_path))


# ---- layer 3: assignment ---------------------------------------------------------------------------


def test_variant_with_none_of_its_operations_on_the_ane_is_refused_with_counts(tmp_path):
    # the seed's silent case: Qwen 3.8 h12288, 0 of 173 operations on the Neural Engine
    runtime = FakeRuntime({"h8192": FakeFunction(assignment={"neural_engine": 0, "gpu": 0, "cpu": 173})})
    with pytest.raises(AneGateError) as e:
        check_variants(runtime, _variants(tmp_path))
    assert "variant h8192" in str(e.value) and "0 of 173" in str(e.value) and "cpu 173" in str(e.value)


def test_one_operation_on_the_ane_is_enough(tmp_path):
    # boundary control: the gate fails on zero, not on "few"
    runtime = FakeRuntime({"h8192": FakeFunction(assignment={"neural_engine": 1, "gpu": 0, "cpu": 172})})
    assert check_variants(runtime, _variants(tmp_path))["h8192"] == {
        "ane_ops": 1,
        "total_ops": 173,
        "stderr_markers": [],
    }


def test_variant_that_reports_nothing_is_refused(tmp_path):
    # like a non-default function of a merged package: the plan lists no device usage at all
    runtime = FakeRuntime({"h0": FakeFunction(assignment=None)})
    with pytest.raises(AneGateError, match=r"variant h0 reports no operation assignments.*0 operations"):
        check_variants(runtime, _variants(tmp_path))


def test_operations_without_a_reported_device_do_not_count(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(assignment={"unreported": 173})})
    with pytest.raises(AneGateError, match="reports no operation assignments"):
        check_variants(runtime, _variants(tmp_path))


def test_gpu_preference_is_not_the_neural_engine(tmp_path):
    runtime = FakeRuntime({"h0": FakeFunction(assignment={"neural_engine": 0, "gpu": 170, "cpu": 3})})
    with pytest.raises(AneGateError, match=r"0 of 173 .*gpu 170"):
        check_variants(runtime, _variants(tmp_path))


def test_a_compute_plan_that_cannot_be_read_is_refused_naming_the_variant(tmp_path):
    runtime = FakeRuntime({"h4096": FakeFunction(plan_error="Failed to build the model execution plan")})
    with pytest.raises(AneGateError, match=r"compute plan of variant h4096 could not be read .*execution plan"):
        check_variants(runtime, _variants(tmp_path))


def test_the_assignment_is_asked_per_variant_package(tmp_path):
    runtime = FakeRuntime()
    variants = _variants(tmp_path)
    check_variants(runtime, variants)
    plans = [c for c in runtime.calls if c[0] == "compute_plan"]
    assert plans == [("compute_plan", str(variants[n]), n, "cpu_and_ne") for n in ("h0", "h4096", "h8192")]


# ---- layer 2: load -----------------------------------------------------------------------------------


def test_variant_that_does_not_load_is_refused_naming_it(tmp_path):
    runtime = FakeRuntime(
        {"h4096": FakeFunction(load_error="Failed to build the model execution plan (error code: 14)")}
    )
    with pytest.raises(AneGateError, match=r"variant h4096 does not load .*execution plan"):
        check_variants(runtime, _variants(tmp_path))


def test_function_that_does_not_load_after_the_merge_is_refused_naming_it(tmp_path):
    merged = tmp_path / "merged.mlpackage"
    merged.mkdir()
    runtime = FakeRuntime({"h8192": FakeFunction(load_error="no Core ML model proxy")})
    with pytest.raises(AneGateError) as e:
        check_merged_loads(runtime, merged, ["h0", "h4096", "h8192"])
    assert "function h8192 of the merged package does not load" in str(e.value) and e.value.function == "h8192"
    loaded = [c[2] for c in runtime.calls if c[0] == "load"]
    assert loaded == ["h0", "h4096", "h8192"]  # every function asked by its own name
    check_merged_loads(FakeRuntime(), merged, ["h0", "h4096", "h8192"])  # control: all load -> no error


def test_marker_during_a_merged_load_is_refused(tmp_path):
    merged = tmp_path / "merged.mlpackage"
    merged.mkdir()
    runtime = FakeRuntime({"h4096": FakeFunction(load_stderr="exception=ANECF error: failed to load ANE model\n")})
    with pytest.raises(AneGateError, match=r"function h4096 .*ANECF error"):
        check_merged_loads(runtime, merged, ["h0", "h4096"])


def test_healthy_variants_give_the_evidence(tmp_path):
    runtime = FakeRuntime(
        {
            "h0": FakeFunction(assignment={"neural_engine": 74, "gpu": 0, "cpu": 99}),
            "h4096": FakeFunction(assignment={"neural_engine": 64, "gpu": 9, "cpu": 100}),
        }
    )
    assert check_variants(runtime, _variants(tmp_path, ("h0", "h4096"))) == {
        "h0": {"ane_ops": 74, "total_ops": 173, "stderr_markers": []},
        "h4096": {"ane_ops": 64, "total_ops": 173, "stderr_markers": []},
    }


def test_gate_refuses_an_unavailable_runtime(tmp_path):
    with pytest.raises(RuntimeUnavailableError):
        check_variants(FakeRuntime(available=False, reason="no Core ML here"), _variants(tmp_path))


# ---- through anelab.export.export_layer ----------------------------------------------------------


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
        "h0": {"ane_ops": 12, "total_ops": 17, "stderr_markers": []},
        "h4": {"ane_ops": 10, "total_ops": 17, "stderr_markers": []},
    }
    # markers + assignment on the single-function variants, then each function loaded from the merge
    variant_loads = [c for c in runtime.calls if c[0] == "load" and Path(c[1]).name in ("h0.mlpackage", "h4.mlpackage")]
    merged_loads = [c for c in runtime.calls if c[0] == "load" and Path(c[1]).name == "merged.mlpackage"]
    assert len(variant_loads) == 2 and [c[2] for c in merged_loads] == ["h0", "h4"]
    first_merged = runtime.calls.index(merged_loads[0])
    assert all(runtime.calls.index(c) < first_merged for c in runtime.calls if c[0] == "compute_plan")


def test_export_refused_by_the_gate_leaves_no_package(checkpoint, tmp_path):
    out = tmp_path / "out"
    runtime = FakeRuntime({"h4": FakeFunction(load_stderr=MARKER)})
    with pytest.raises(AneGateError, match=r"variant h4 .*ANECCompile\(\) FAILED"):
        export_layer(checkpoint, 0, 4, [0, 4], out, gate=AneGate.for_runtime(runtime))
    assert list(out.iterdir()) == []  # no package, no half-written temporary directory


def test_export_refused_after_the_merge_names_the_function(checkpoint, tmp_path):
    runtime = FakeRuntime()
    real_load = runtime.load

    def load(pkg, function, units):  # h4 loads as a variant but not from the merged package
        if function == "h4":
            runtime.functions["h4"] = FakeFunction(load_error="function not found")
        return real_load(pkg, function, units)

    runtime.load = load
    with pytest.raises(AneGateError, match="function h4 of the merged package does not load"):
        export_layer(checkpoint, 0, 4, [0, 4], tmp_path / "out", gate=AneGate.for_runtime(runtime))


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
