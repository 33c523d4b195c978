"""``MacRuntime`` against a recording stand-in of coremltools 9.0's API: the Core ML path is right by
construction — compile once, ``CompiledMLModel`` per function by name, state passed, plan of the
compiled copy, inputs converted outside the caller's dict.

Each test fails on 6b7ba86, where ``load`` built ``MLModel(<x>.mlpackage, ...)`` on every call (a
whole-package compile each time, defect 2), ``predict`` took no state (defect 1) and let
coremltools cast fp16 inputs inside the caller's dict (defect 10).
"""

from __future__ import annotations

import enum
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import seed_passed_verdicts

from anelab.core.errors import AnelabInputError
from anelab.runtimes.coreml.coreml_runtime import MacRuntime
from anelab.runtimes.interface import RuntimeLoadError, RuntimePredictError


class CoreMLToolsStandIn:
    """The parts of coremltools 9.0 MacRuntime uses, recording each call (behaviour per the 9.0 sources)."""

    ComputeUnit = enum.Enum("ComputeUnit", ["ALL", "CPU_AND_GPU", "CPU_ONLY", "CPU_AND_NE"])  # coremltools/__init__.py

    def __init__(self):
        self.calls: list[tuple] = []
        stand_in = self
        compute_unit = self.ComputeUnit

        class CompiledMLModel:
            def __init__(self, path, compute_units=compute_unit.ALL, function_name=None):
                if not isinstance(compute_units, compute_unit):  # _compiled_model.py:46-47
                    raise TypeError('The "compute_units" parameter must be of type: "coremltools.ComputeUnit".')
                stand_in.calls.append(("CompiledMLModel", path, compute_units.name, function_name))
                # the native proxy's own durations (CoreMLPython.mm:1041-1055)
                self._proxy = SimpleNamespace(
                    get_load_duration_in_nano_seconds=lambda: 2_500_000_000,
                    get_last_predict_duration_in_nano_seconds=lambda: 40_000_000,
                )
                if function_name == "missing":  # Core ML refuses: CompiledMLModel raises (no warning)
                    raise RuntimeError('{\n    NSLocalizedDescription = "function missing not found";\n}')
                self.function_name = function_name or ""  # _compiled_model.py:102-103: None means ""

            def make_state(self):
                stand_in.calls.append(("make_state", self.function_name))
                return "MLState"

            def predict(self, data, state=None):
                stand_in.calls.append(("predict", self.function_name, {k: v.dtype for k, v in data.items()}, state))
                if self.function_name.startswith("c") and state is None:
                    raise RuntimeError(
                        '{\n    NSLocalizedDescription = "The input feature for k_cache must be an MLState, but it was not.";\n}'
                    )
                for k, v in data.items():  # coremltools casts fp16 to fp32 in the caller's dict
                    if v.dtype == np.float16:
                        data[k] = v.astype(np.float32)
                return {"attn_out": np.zeros(1, np.float32)}

        def MLModel(path, compute_units=None, function_name=None):  # noqa: N802 - mirrors coremltools
            stand_in.calls.append(("MLModel", path, compute_units, function_name))
            return SimpleNamespace(__proxy__=object())

        def compile_model(path, destination_path=None):
            if not path.rstrip("/").endswith((".mlpackage", ".mlmodel")):  # utils.py:1098-1100,1112-1119
                raise ValueError(
                    f"Invalid model file path: '{path}'.Expected a file with .mlpackage or .model extension. "
                )
            if destination_path is not None and not destination_path.rstrip("/").endswith(".mlmodelc"):
                raise Exception('"destination_path" parameter must have ".mlmodelc" file extension.')  # :1134-1135
            stand_in.calls.append(("compile_model", path, destination_path))
            Path(destination_path).mkdir(parents=True)
            return destination_path

        self.models = SimpleNamespace(CompiledMLModel=CompiledMLModel, MLModel=MLModel)

        def macos_version():  # utils.py:959-968: sw_vers in a subprocess, lru-cached
            stand_in.calls.append(("_macos_version",))
            return (15, 2)

        self.utils = SimpleNamespace(compile_model=compile_model, _macos_version=macos_version)

    def named(self, kind):
        return [c for c in self.calls if c[0] == kind]


@pytest.fixture
def mac(tmp_path, monkeypatch):
    ct = CoreMLToolsStandIn()
    runtime = MacRuntime(
        platform_name="darwin",
        machine="arm64",
        macos_version=lambda: (15, 2),
        import_native=lambda: None,
        ct=lambda: ct,
        cache_dir=tmp_path / "compiled",
    )
    seed_passed_verdicts(runtime)
    runtime.preflights = preflights = []  # the stand-in cannot run a child: record what would have been pre-flighted
    monkeypatch.setattr(MacRuntime, "preflight", lambda self, *args: preflights.append(args))
    pkg = tmp_path / "layer_3.mlpackage"
    pkg.mkdir()
    (pkg / "Manifest.json").write_text("{}")
    return runtime, ct, pkg


def test_a_package_is_compiled_once_and_each_function_loads_by_name_from_the_compiled_copy(mac):
    runtime, ct, pkg = mac
    runtime.load(pkg, "h0", "cpu_and_ne")
    runtime.load(pkg, "h4096", "cpu_and_ne")
    runtime.load(pkg, "h0", "cpu_only")
    compiles = ct.named("compile_model")
    assert len(compiles) == 1 and compiles[0][1] == str(pkg)
    compiled = str(runtime.compiled_path(pkg))  # compiled beside it, then moved into place atomically
    assert compiled.endswith(".mlmodelc") and Path(compiles[0][2]).name == Path(compiled).name
    assert Path(compiled).parent == runtime.cache_dir and Path(compiled).is_dir()
    assert ct.named("CompiledMLModel") == [
        ("CompiledMLModel", compiled, "CPU_AND_NE", "h0"),
        ("CompiledMLModel", compiled, "CPU_AND_NE", "h4096"),
        ("CompiledMLModel", compiled, "CPU_ONLY", "h0"),
    ]
    assert ct.named("MLModel") == []  # never the per-load compile of MLModel(<x>.mlpackage)
    # every Neural Engine load was first run in a child (load + predict); the cpu_only one was not
    assert [(f, u, s) for _, f, u, s in runtime.preflights] == [
        ("h0", "cpu_and_ne", ("load", "predict")), ("h4096", "cpu_and_ne", ("load", "predict")),
    ]  # fmt: skip


def test_the_compiled_copy_is_reused_by_a_new_runtime_and_renewed_when_the_package_changes(mac, tmp_path):
    runtime, ct, pkg = mac
    runtime.load(pkg, "h0", "cpu_and_ne")
    again = MacRuntime(
        platform_name="darwin", macos_version=lambda: (15, 2), import_native=lambda: None, ct=lambda: ct,
        cache_dir=runtime.cache_dir,
    )  # fmt: skip
    again.load(pkg, "h0", "cpu_and_ne")
    assert len(ct.named("compile_model")) == 1  # cached on disk by content hash
    (pkg / "Manifest.json").write_text('{"re-exported": true}')
    again.load(pkg, "h0", "cpu_and_ne")
    assert len(ct.named("compile_model")) == 2


def test_a_function_core_ml_refuses_is_a_load_error_in_one_line(mac):
    runtime, _, pkg = mac
    with pytest.raises(RuntimeLoadError) as e:
        runtime.load(pkg, "missing", "cpu_and_ne")
    assert "function missing not found" in str(e.value) and "\n" not in str(e.value)


def test_a_stateful_function_gets_its_state(mac):
    runtime, ct, pkg = mac
    handle = runtime.load(pkg, "c4", "cpu_and_ne")
    inputs = {"hidden": np.zeros((4, 8), np.float32)}
    with pytest.raises(RuntimePredictError, match="must be an MLState"):  # control: what Core ML says without it
        runtime.predict(handle, inputs)
    runtime.predict(handle, inputs, state=runtime.make_state(handle))
    assert ct.named("predict")[-1][3] == "MLState"


def test_the_timed_predict_gets_inputs_already_converted_and_the_callers_dict_is_untouched(mac):
    from anelab.runtimes.coreml.coreml_fake import FakeClock
    from anelab.runtimes.coreml.timing import time_predict

    runtime, ct, pkg = mac
    given = {"hidden": np.zeros((4, 8), np.float16)}
    record = time_predict(runtime, pkg, "h0", given, ["cpu_only"], warmup=0, repeats=1, clock=FakeClock())
    assert "error" not in record["results"]["cpu_only"]
    assert record["results"]["cpu_only"]["core_ml_predict_s"]["samples_s"] == [0.04]  # the proxy's own duration
    first_use, timed = ct.named("predict")  # the tiny first-use model (input x), then the timed predict
    assert first_use[1] == "" and timed[2] == {"hidden": np.float32}  # converted before the call
    assert given["hidden"].dtype == np.float16


def test_the_compute_plan_is_refused_for_anything_but_a_compiled_copy(mac):
    runtime, _, pkg = mac
    with pytest.raises(ValueError, match="needs a compiled .mlmodelc"):  # coremltools 9.0 would abort (#2757)
        runtime.plan_path(pkg, "cpu_and_ne")


def test_compute_units_reach_coremltools_as_the_enum_it_demands(mac):
    """``CompiledMLModel`` raises TypeError for anything but ``ct.ComputeUnit`` (_compiled_model.py:46-47)."""
    runtime, ct, pkg = mac
    runtime.load(pkg, "h0", "cpu_and_gpu")
    assert ct.named("CompiledMLModel")[-1][2] == "CPU_AND_GPU"
    compiled = str(runtime.compiled_path(pkg))
    with pytest.raises(TypeError, match="coremltools.ComputeUnit"):  # control: a string, as a kinder stand-in took it
        ct.models.CompiledMLModel(compiled, "CPU_AND_GPU", function_name="h0")


def test_the_compile_keeps_coremltools_suffix_rules(mac, tmp_path):
    """compile_model demands <x>.mlpackage -> <y>.mlmodelc (utils.py:1098-1100,1112-1119,1134-1135)."""
    runtime, ct, pkg = mac
    runtime.compile(pkg)  # the cache path ends .mlmodelc
    odd = tmp_path / "not_a_package"
    odd.mkdir()
    (odd / "Manifest.json").write_text("{}")
    with pytest.raises(RuntimeLoadError, match="Invalid model file path"):
        runtime.compile_to(odd, tmp_path / "odd.mlmodelc")
    with pytest.raises(AnelabInputError, match="does not end in .mlpackage"):  # refused before Core ML is asked
        runtime.compile(odd)


def test_prepare_process_runs_the_first_use_work_and_durations_come_from_the_proxy(mac):
    runtime, ct, pkg = mac
    done = runtime.prepare_process()
    assert ct.named("_macos_version") and any("sw_vers" in step for step in done)
    handle = runtime.load(pkg, "h0", "cpu_only")
    assert runtime.load_duration_s(handle) == 2.5
    runtime.predict(handle, {"hidden": np.zeros((4, 8), np.float32)})
    assert runtime.predict_duration_s(handle) == 0.04
