"""The Core ML behaviours anelab relies on, each with the coremltools 9.0 source behind it and the compute units
its dependants run under.

``anelab doctor --probe`` (``anelab.runtimes.coreml.probe``) exercises every one on tiny packages, in child processes,
under each compute-units setting of its row (``CoreMLAssumption.compute_units``; ``ANY_UNITS``: the behaviour
takes no compute units), and records it passed or failed by name and setting, stamped with the chip, macOS and
coremltools versions. Code that relies on an assumption asks for it under the compute units it runs with
(``CoreMLRuntime.require_assumptions``): a failed verdict refuses naming it; an unprobed or stale one (another
macOS or coremltools) runs the probe first. Line numbers are of tag 9.0 of apple/coremltools.
"""

from __future__ import annotations

from dataclasses import dataclass

# the compute-units settings a probe child runs under ("all" is judged by the two it may place work on)
PROBE_UNITS = ("cpu_and_ne", "cpu_and_gpu", "cpu_only")
ANY_UNITS = "any"  # a behaviour that takes no compute units (compile, fd capture, the unified log)
ALL_UNITS_COVERED_BY = ("cpu_and_ne", "cpu_and_gpu")  # "all" may place an operation on either
ANE_ONLY = ("cpu_and_ne",)


@dataclass(frozen=True)
class CoreMLAssumption:
    """One behaviour of Core ML through coremltools that anelab's code counts on."""

    name: str  # how probes, records and refusals name it
    behaviour: str  # what is assumed, in one sentence
    source: str  # the coremltools 9.0 lines (or the issue) it comes from
    relied_on_by: str  # the anelab code that refuses when it is false
    compute_units: tuple[str, ...] = PROBE_UNITS  # the settings the probe checks it under (its dependants' ones)


COMPILE_TO_MLMODELC = "compile_to_mlmodelc"
LOAD_FUNCTION_BY_NAME = "load_function_by_name"
FP32_FEEDS_FP16_INPUTS = "fp32_arrays_feed_fp16_inputs"
INT32_INPUTS_ACCEPTED = "int32_arrays_accepted"
FP16_OUTPUTS_AS_FP32 = "fp16_outputs_come_back_as_fp32"
UNSUPPORTED_DTYPE_REFUSED = "int64_arrays_refused"
READ_ONLY_REFUSED = "read_only_arrays_refused"
STATE_BY_NAME = "make_state_and_read_state_by_name"
FRESH_STATE_ZEROED = "fresh_state_is_zero_filled"
STATE_SHARED_BY_FUNCTIONS = "one_state_shared_by_two_functions"
COMPUTE_PLAN_OF_COMPILED = "compute_plan_of_a_compiled_model"
PROBE_ON_ANE = "probe_graphs_reach_the_neural_engine"
UNGATED_LOAD_AND_PLAN_SURVIVE = "ungated_load_and_plan_survive"
CORE_ML_LOAD_DURATION = "core_ml_load_duration"
CORE_ML_PREDICT_DURATION = "core_ml_predict_duration"
FRESH_COPY_COMPILES_COLD = "fresh_copy_compiles_cold"
MERGED_LIKE_VARIANT = "merged_function_compiles_like_its_variant"
STATEFUL_PREDICTS_STABLE = "stateful_predicts_stable"
NATIVE_OUTPUT_ON_FDS = "native_output_captured_on_fd1_fd2"
UNIFIED_LOG_READABLE = "unified_log_readable"
CORE_ML_LOGS_FOR_CLIENT = "core_ml_logs_reach_the_client_pid"


ASSUMPTIONS: tuple[CoreMLAssumption, ...] = (
    CoreMLAssumption(
        COMPILE_TO_MLMODELC,
        "ct.utils.compile_model(<x>.mlpackage, <y>.mlmodelc) compiles the package into that directory",
        "coremltools/models/utils.py:1098-1100,1112-1119 (source must end .mlpackage/.mlmodel), "
        "1134-1135 (destination must end .mlmodelc), 1144-1149 (compileModel, then shutil.move)",
        "CoreMLRuntime.compile (every load and compute plan reads the compiled copy)",
        (ANY_UNITS,),
    ),
    CoreMLAssumption(
        LOAD_FUNCTION_BY_NAME,
        "CompiledMLModel(<y>.mlmodelc, ComputeUnit, function_name=f) loads function f of a multifunction package "
        "and refuses a name the package lacks",
        "coremltools/models/_compiled_model.py:46-47 (ComputeUnit enum only), 135-137; "
        "coremlpython/CoreMLPython.mm:489-495 (configuration.functionName), 500-503",
        "CoreMLRuntime.load",
    ),
    CoreMLAssumption(
        FP32_FEEDS_FP16_INPUTS,
        "fp32 arrays feed fp16 inputs and the outputs match the saved program (NumPy) within fp16 noise",
        "coremltools/models/model.py:1064-1067; coremlpython/CoreMLPythonArray.mm:24-25",
        "every predict (anelab.runtimes.interface.prepare_inputs casts fp16 to fp32 once)",
    ),
    CoreMLAssumption(
        INT32_INPUTS_ACCEPTED,
        "an int32 array reaches the graph as its value (a stateful sidecar's start [1] picks the cache slots)",
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
        READ_ONLY_REFUSED,
        "a read-only fp32 or int32 array is refused (MLMultiArray wraps array.mutable_data())",
        "coremlpython/CoreMLPythonArray.mm:55 (mutable_data), CoreMLPythonUtils.mm:397-409 (refused after printing)",
        "prepare_inputs (hands Core ML contiguous writable arrays) and the fake runtime's read-only rule",
    ),
    CoreMLAssumption(
        STATE_BY_NAME,
        "make_state() gives a fresh MLState and read_state(name) returns a state's contents by name",
        "coremltools/models/_compiled_model.py:234-249; coremltools/models/model.py:202-224; "
        "coremlpython/CoreMLPython.mm:682-712",
        "stateful predicts (open_sidecar, verify on the device)",
    ),
    CoreMLAssumption(
        FRESH_STATE_ZEROED,
        "a fresh MLState holds zeros (a new prompt starts from an empty cache)",
        "not documented: coremlpython/CoreMLPython.mm:684-686 returns [MLModel newState] as it comes",
        "Sidecar.reset_state and verify on the device (a prompt's first chunk runs on a fresh state)",
    ),
    CoreMLAssumption(
        STATE_SHARED_BY_FUNCTIONS,
        "one MLState made by function c<C>'s handle serves the separately loaded c1 handle: c1's output on it "
        "matches the saved program (NumPy) after the same prefill",
        "not documented: coremlpython/CoreMLPython.mm:549-552 only passes the state to "
        "[MLModel predictionFromFeatures:usingState:] of whichever handle predicts",
        "Sidecar.decode (c1 after a c<C> prefill) and verify on the device across functions",
    ),
    CoreMLAssumption(
        COMPUTE_PLAN_OF_COMPILED,
        "MLComputePlan.load_from_path(<y>.mlmodelc) plans the package's operations per preferred device",
        "coremltools/models/compute_plan.py:403-448; coremlpython/CoreMLPython.mm:826-850",
        "CoreMLRuntime.compute_plan_assignment (the ANE gate's operation count)",
    ),
    CoreMLAssumption(
        PROBE_ON_ANE,
        "the probe's own tiny stateful graph is planned on the Neural Engine under cpu_and_ne (operations and its "
        "matmuls / softmax), so the verdicts its cpu_and_ne child records are the Neural Engine's",
        "coremltools/models/compute_plan.py:403-448 (the plan of the compiled probe package); Core ML may keep a "
        "graph this small on the CPU",
        "every later check of the probe's cpu_and_ne child (each needs it, else 'not run'), hence every cpu_and_ne "
        "verdict code relies on — the gate's among them",
        ANE_ONLY,
    ),
    CoreMLAssumption(
        UNGATED_LOAD_AND_PLAN_SURVIVE,
        "loading and planning a package the gate never passed, under the Neural Engine, leaves the process alive "
        "(only a predict kills)",
        "apple/coremltools#2758 (SIGKILL at the first predict); coremlpython/CoreMLPython.mm:489-503 (each function "
        "is compiled for the device by modelWithContentsOfURL in the loading process)",
        "nothing in the measuring process any more: every Neural Engine load and compute plan runs first in a "
        "child (runtimes.coreml.gate.preflight); recorded so a Mac where it is false is known",
        ANE_ONLY,
    ),
    CoreMLAssumption(
        CORE_ML_LOAD_DURATION,
        "a loaded handle reports Core ML's own load duration (modelWithContentsOfURL alone)",
        "coremlpython/CoreMLPython.mm:497-503,517 (measured), 1041-1047 (get_load_duration_in_nano_seconds)",
        "anelab.runtimes.coreml.timing.time_load (core_ml_load_s)",
    ),
    CoreMLAssumption(
        CORE_ML_PREDICT_DURATION,
        "a handle reports Core ML's own duration of its last predict (no input or output conversion)",
        "coremlpython/CoreMLPython.mm:543-562 (measured), 1049-1055 (get_last_predict_duration_in_nano_seconds)",
        "anelab.runtimes.coreml.timing.time_predict and the A/B ratio (anelab.runtimes.coreml.block_ab.timing_stats)",
    ),
    CoreMLAssumption(
        FRESH_COPY_COMPILES_COLD,
        "a freshly compiled copy at a new path loads cold: its Core ML load takes longer than a reload of a copy "
        "already loaded (no content-keyed cache serves it)",
        "coremlpython/CoreMLPython.mm:497-503 (what a load times); no coremltools line says what aned caches",
        "anelab.runtimes.coreml.timing.time_load(cold=True) under the Neural Engine",
        ANE_ONLY,
    ),
    CoreMLAssumption(
        MERGED_LIKE_VARIANT,
        "a function of a merged multifunction package is planned and computes like its single-function variant",
        "coremlpython/CoreMLPython.mm:489-503 (the merged .mlmodelc's function is compiled in the loading process); "
        "the gate plans only variants (compute plans see the default function, compute_plan.py:403-448)",
        "the ANE gate's verdict on a merged package (aneCompileVerified)",
        ANE_ONLY,
    ),
    CoreMLAssumption(
        STATEFUL_PREDICTS_STABLE,
        "a 4-bit palettized stateful function survives many sequential predicts on the Neural Engine with "
        "unchanged outputs",
        "apple/coremltools#2716 (a palettized stateful model built with 9.0 crashes after ~100-200 predicts under "
        "CPU_AND_NE)",
        "open_sidecar of a palettize4 stateful sidecar under the Neural Engine",
        ANE_ONLY,
    ),
    CoreMLAssumption(
        NATIVE_OUTPUT_ON_FDS,
        "text native code writes to fd 1 and fd 2 is captured by swapping the file descriptors",
        "coremlpython/CoreMLPython.mm:459-471 (coremltools itself silences the compiler by swapping fd 1)",
        "the ANE gate's marker search on fd 1 / fd 2",
        (ANY_UNITS,),
    ),
    CoreMLAssumption(
        UNIFIED_LOG_READABLE,
        "'log show' returns, after a child exited, the lines that child logged, unredacted, for its PID",
        "no coremltools line: Core ML's [espresso]/[coreml] lines reach only the unified log (macOS 'log' tool)",
        "the ANE gate's marker search in the unified log of its exited children",
        (ANY_UNITS,),
    ),
    CoreMLAssumption(
        CORE_ML_LOGS_FOR_CLIENT,
        "at least one readable (unredacted) Core ML line reaches the unified log for the client's PID or the Neural "
        "Engine's helper processes (ANECompilerService, aned) while it loads and predicts on the Neural Engine; "
        "lines are Core ML's when they name coreml, espresso, e5rt or ane as a word",
        "no coremltools line; Apple's frameworks log arguments as <private> by default and info lines are often not "
        "persisted; the gate reads its child's PID and the helpers' (runtimes/coreml/gate.py run_child)",
        "the ANE gate's evidence: where it failed, every verdict carries the caveat (runtimes.coreml.gate.unified_log_caveat) "
        "that an ANE failure reported only in the log would be missed",
        ANE_ONLY,
    ),
)


ASSUMPTION_NAMES = tuple(a.name for a in ASSUMPTIONS)


def assumption(name: str) -> CoreMLAssumption:
    """The assumption called ``name`` (KeyError for an unknown name)."""
    for entry in ASSUMPTIONS:
        if entry.name == name:
            return entry
    raise KeyError(name)


def settings_needed(name: str, compute_units: str | None) -> tuple[str, ...]:
    """The probe settings whose verdicts must have passed for code running ``name``'s behaviour under
    ``compute_units`` (None: every setting of its row; "all": those of the two it may place work on). A setting
    the row does not list needs nothing (e.g. an ANE-only behaviour under ``cpu_only``)."""
    declared = assumption(name).compute_units
    if ANY_UNITS in declared:
        return (ANY_UNITS,)
    if compute_units is None:
        return declared
    wanted = ALL_UNITS_COVERED_BY if compute_units == "all" else (compute_units,)
    return tuple(u for u in wanted if u in declared)
