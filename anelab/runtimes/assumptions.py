"""The Core ML behaviours anelab relies on, each with the coremltools 9.0 source line behind it.

``anelab doctor --probe`` (``anelab.runtimes.probe``) exercises every one on a tiny package and records
it passed or failed by name; code that relies on an assumption the probe found false refuses with
that name (``CoreMLRuntime.require_assumptions``) instead of measuring. Line numbers are of tag 9.0
of apple/coremltools.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoreMLAssumption:
    """One behaviour of Core ML through coremltools that anelab's code counts on."""

    name: str  # how probes, records and refusals name it
    behaviour: str  # what is assumed, in one sentence
    source: str  # the coremltools 9.0 lines it comes from
    relied_on_by: str  # the anelab code that refuses when it is false


COMPILE_TO_MLMODELC = "compile_to_mlmodelc"
LOAD_FUNCTION_BY_NAME = "load_function_by_name"
FP32_FEEDS_FP16_INPUTS = "fp32_arrays_feed_fp16_inputs"
INT32_INPUTS_ACCEPTED = "int32_arrays_accepted"
FP16_OUTPUTS_AS_FP32 = "fp16_outputs_come_back_as_fp32"
UNSUPPORTED_DTYPE_REFUSED = "int64_arrays_refused"
STATE_BY_NAME = "make_state_and_read_state_by_name"
STATE_SHARED_BY_FUNCTIONS = "one_state_shared_by_two_functions"
COMPUTE_PLAN_OF_COMPILED = "compute_plan_of_a_compiled_model"
CORE_ML_LOAD_DURATION = "core_ml_load_duration"
CORE_ML_PREDICT_DURATION = "core_ml_predict_duration"
NATIVE_OUTPUT_ON_FDS = "native_output_captured_on_fd1_fd2"
UNIFIED_LOG_READABLE = "unified_log_readable"


ASSUMPTIONS: tuple[CoreMLAssumption, ...] = (
    CoreMLAssumption(
        COMPILE_TO_MLMODELC,
        "ct.utils.compile_model(<x>.mlpackage, <y>.mlmodelc) compiles the package into that directory",
        "coremltools/models/utils.py:1098-1100,1112-1119 (source must end .mlpackage/.mlmodel), "
        "1134-1135 (destination must end .mlmodelc), 1144-1149 (compileModel, then shutil.move)",
        "CoreMLRuntime.compile (every load and compute plan reads the compiled copy)",
    ),
    CoreMLAssumption(
        LOAD_FUNCTION_BY_NAME,
        "CompiledMLModel(<y>.mlmodelc, ComputeUnit, function_name=f) loads function f of a multifunction package",
        "coremltools/models/_compiled_model.py:46-47 (ComputeUnit enum only), 135-137; "
        "coremlpython/CoreMLPython.mm:489-495 (configuration.functionName), 500-503",
        "CoreMLRuntime.load",
    ),
    CoreMLAssumption(
        FP32_FEEDS_FP16_INPUTS,
        "fp32 arrays feed fp16 inputs (fp16 arrays are cast to fp32 by coremltools first)",
        "coremltools/models/model.py:1064-1067; coremlpython/CoreMLPythonArray.mm:24-25",
        "every predict (anelab.runtimes.interface.prepare_inputs casts fp16 to fp32 once)",
    ),
    CoreMLAssumption(
        INT32_INPUTS_ACCEPTED,
        "int32 arrays are accepted as inputs (a stateful sidecar's start [1])",
        "coremlpython/CoreMLPythonArray.mm:16-17",
        "every predict of a stateful sidecar",
    ),
    CoreMLAssumption(
        FP16_OUTPUTS_AS_FP32,
        "fp16 outputs come back as fp32 NumPy arrays (a converted copy)",
        "coremlpython/CoreMLPythonUtils.mm:448-452 (concatenate to Float32), 464-484 (copied into NumPy)",
        "every predict (outputs compared as fp32)",
    ),
    CoreMLAssumption(
        UNSUPPORTED_DTYPE_REFUSED,
        "an int64 array is refused ('value type not convertible', after printing to stdout)",
        "coremlpython/CoreMLPythonArray.mm:10-31 (int32/fp32/fp64 only), CoreMLPythonUtils.mm:397-409",
        "the fake runtime's dtype rule (tests on Linux stand in for this Mac only while it holds)",
    ),
    CoreMLAssumption(
        STATE_BY_NAME,
        "make_state() gives a fresh MLState and read_state(name) returns a state's contents by name",
        "coremltools/models/_compiled_model.py:234-249; coremltools/models/model.py:202-224; "
        "coremlpython/CoreMLPython.mm:682-712",
        "stateful predicts (open_sidecar, verify on the device)",
    ),
    CoreMLAssumption(
        STATE_SHARED_BY_FUNCTIONS,
        "one MLState made by function c<C>'s handle serves the separately loaded c1 handle and carries its K/V",
        "not documented: coremlpython/CoreMLPython.mm:549-552 only passes the state to "
        "[MLModel predictionFromFeatures:usingState:] of whichever handle predicts",
        "Sidecar.decode (c1 after a c<C> prefill) and verify on the device across functions",
    ),
    CoreMLAssumption(
        COMPUTE_PLAN_OF_COMPILED,
        "MLComputePlan.load_from_path(<y>.mlmodelc) plans the package's operations per preferred device",
        "coremltools/models/compute_plan.py:403-448; coremlpython/CoreMLPython.mm:838-850",
        "CoreMLRuntime.compute_plan_assignment (the ANE gate's operation count)",
    ),
    CoreMLAssumption(
        CORE_ML_LOAD_DURATION,
        "a loaded handle reports Core ML's own load duration (modelWithContentsOfURL alone)",
        "coremlpython/CoreMLPython.mm:497-503,517 (measured), 1041-1047 (get_load_duration_in_nano_seconds)",
        "anelab.runtimes.timing.time_load (core_ml_load_s)",
    ),
    CoreMLAssumption(
        CORE_ML_PREDICT_DURATION,
        "a handle reports Core ML's own duration of its last predict (no input or output conversion)",
        "coremlpython/CoreMLPython.mm:543-562 (measured), 1049-1055 (get_last_predict_duration_in_nano_seconds)",
        "anelab.runtimes.timing.time_predict (core_ml_predict_s, conversion_share)",
    ),
    CoreMLAssumption(
        NATIVE_OUTPUT_ON_FDS,
        "text native code writes to fd 1 and fd 2 is captured by swapping the file descriptors",
        "coremlpython/CoreMLPython.mm:459-471 (coremltools itself silences the compiler by swapping fd 1)",
        "the ANE gate's marker search on fd 1 / fd 2",
    ),
    CoreMLAssumption(
        UNIFIED_LOG_READABLE,
        "'log show' returns this process's unified-log lines for a time window",
        "no coremltools line: Core ML's [espresso]/[coreml] lines reach only the unified log (macOS 'log' tool)",
        "the ANE gate's marker search in the unified log (a failure makes the verdict unknown)",
    ),
)


ASSUMPTION_NAMES = tuple(a.name for a in ASSUMPTIONS)


def assumption(name: str) -> CoreMLAssumption:
    """The assumption called ``name`` (KeyError for an unknown name)."""
    for entry in ASSUMPTIONS:
        if entry.name == name:
            return entry
    raise KeyError(name)
