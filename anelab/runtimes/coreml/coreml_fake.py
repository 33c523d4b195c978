"""A ``CoreMLRuntime`` for tests that behaves like Core ML through coremltools 9.0 — never kinder.

Each rule copies a line of coremltools at tag 9.0 (apple/coremltools; ``.mm`` files under
``coremlpython/``, ``.py`` files under ``coremltools/models/``):

- **compile** (``compile_to``): the source must end ``.mlpackage`` or ``.mlmodel`` (ValueError,
  ``utils.py:1098-1100,1112-1119``) and the destination ``.mlmodelc`` (``utils.py:1134-1135``);
  ``compile_s`` on the clock;
- **first use**: the first availability check of a process imports coremltools and its native module
  (``import_s``); the first compile or ``CompiledMLModel`` of a process runs ``sw_vers`` in a
  subprocess (``first_use_s``; ``_compiled_model.py:34`` and ``utils.py:1103`` -> ``utils.py:959-968``,
  lru-cached so once per process); ``prepare_process`` does both before any clock starts;
- **load**: an ``.mlpackage`` is compiled afresh on EVERY load into a temporary
  ``<stem>_<uuid>.mlmodelc`` deleted when the handle dies (``CoreMLPython.mm:457-466,436-443``);
  a ``.mlmodelc`` loads as it is. The first load of a compiled path is cold (``cold_load_s``),
  later loads warm (``warm_load_s``); the load seconds are the handle's Core ML load duration
  (``load_duration_s``; ``CoreMLPython.mm:500-503,517,1041-1047``). Releasing a handle costs
  ``teardown_s``;
- **inputs**: fp16 arrays are cast to fp32 in the CALLER's dict first (``model.py:1064-1067``,
  ``convert_s``), so a read-only fp16 array passes; then only int32, fp32 and fp64 arrays are
  accepted (``CoreMLPythonArray.mm:10-31``) and only writable ones (``mutable_data()``,
  ``CoreMLPythonArray.mm:55``): anything else prints ``Error: value type not convertible:`` to
  stdout and fails with "value type not convertible" (``CoreMLPythonUtils.mm:397-409``);
- **input names**: a handle loaded from an ``.mlpackage`` (``MLModel``) refuses an extra input name
  (KeyError, ``model.py:1055-1060``); a ``CompiledMLModel`` never checks names
  (``_compiled_model.py:227-231``), so an extra input is ignored; a missing input, a wrong shape, or
  a stateful function without a state fail in Core ML (``CoreMLPythonUtils.mm:38-43``);
- **predict clock**: Core ML's own prediction (``predict_s``, what ``predict_duration_s`` reports,
  ``CoreMLPython.mm:543-562``) and, outside it, the output conversion to NumPy (``output_convert_s``:
  fp16 outputs concatenated to fp32 and copied, ``CoreMLPythonUtils.mm:448-484``);
- **state**: ``make_state`` gives a fresh ``MLState``; ``read_state`` of an unknown name raises
  (``CoreMLPython.mm:693-712``);
- ANE compiler messages arrive where Core ML puts them: on fd 1, on fd 2, only at process exit
  (``atexit``), or only in the unified log (a per-process file read by ``read_unified_log``);
- the compute plan needs a compiled ``.mlmodelc``: an ``.mlpackage`` aborts the process (SIGABRT,
  apple/coremltools#2757); a scripted ``predict_signal`` kills the process at predict (#2758).
  In-process (tests) a crash raises ``FakeCrash`` (a ``BaseException``, as uncatchable by
  ``except Exception`` as a signal); in a child process (``real_crashes=True``) it is a real signal.

``lacks``: names of ``anelab.runtimes.coreml.assumptions`` this fake Mac breaks (a Mac where the probe would
fail them), e.g. ``one_state_shared_by_two_functions`` or ``unified_log_readable``; ``name@units`` breaks it
under one compute-units setting only (``one_state_shared_by_two_functions@cpu_and_ne``: the ANE backend
refuses what the CPU does). ``probed`` (default) seeds the verdicts the probe finds on this fake Mac
(``expected_verdicts``, stamped with ``chip`` / ``macos`` / coremltools; ``tests/runtimes/coreml/test_mac_contact.py`` runs the
probe and compares); ``probed=False`` is a Mac never probed, so the first use of an assumption probes.

Per compute units, as Core ML differs per backend: ``FakeFunction.signal_units`` limits a crash to some
settings (an ANE-only SIGKILL, ``signal_when_merged``: only from a merged package, where each function is
compiled for the device by the loading process, ``CoreMLPython.mm:489-503``); ``numerics`` outputs carry
fp16-sized relative noise per setting (``noise``; the CPU the least); a load's wall time is Core ML's load
duration plus ``load_call_s`` (argument checks and the proxy, outside ``modelWithContentsOfURL``); the
process's first load also pays ``core_ml_first_use_s`` inside Core ML's own duration (``CoreMLPython.mm:500-503``
times the process's first ``modelWithContentsOfURL``); ``exit_stdout`` is printed to fd 1 at exit.

Issue 41: ``versions()`` spawns three processes as ``sysctl``/``sw_vers`` do; log lines may be redacted, missing or
a helper's (``core_ml_lines``); a merged plan lists every function; the first-use model may stay on the CPU
(``first_use_on_ane``); ANE outputs carry fp16-accumulation noise of their width, the same for the same values.

Functions are identified by name: ``load(pkg, "h4096", ...)`` is function ``h4096``; a
single-function package loaded with ``function=None`` is identified by its file stem (the exporter
writes each variant as ``h<H>.mlpackage`` before the merge). Time comes from a ``FakeClock`` that
only moves when the fake "works", so timings are exact.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
import weakref
import zlib
from pathlib import Path

import numpy as np

from anelab.runtimes.coreml import assumptions as a
from anelab.runtimes.coreml.coreml_fake_log import UNREADABLE_LINES, FakeUnifiedLog
from anelab.runtimes.coreml.coreml_fake_script import (
    FIRST_USE_ON_CPU,  # noqa: F401 - FakeClock, FakeCrash, FakeState are imported from here too
    FIRST_USE_SCRIPT,
    CallList,
    FakeClock,
    FakeCrash,
    FakeFunction,
    FakeHandle,
    FakeState,
    check_predict_inputs,
)
from anelab.runtimes.coreml.device_verify import fp16_accumulation_error
from anelab.runtimes.coreml.gate import preflight
from anelab.runtimes.coreml.probe import probe_core_ml
from anelab.runtimes.interface import (
    ASSIGNMENT_KEYS,
    NEURAL_ENGINE_UNITS,
    CoreMLRuntime,
    FunctionSignature,
    NativeOutput,
    RuntimeLoadError,
    RuntimePredictError,
    UnifiedLogUnavailable,
    capture_native_output,
    check_compute_units,
    function_signatures,
)
from anelab.sidecar.mil.evaluate import SavedPackage, evaluate, evaluate_with_state

# fp16-sized relative noise of Core ML's outputs per setting (fp16 epsilon 9.8e-4; the CPU accumulates in fp32)
DEVICE_NOISE = {"cpu_and_ne": 1e-3, "all": 1e-3, "cpu_and_gpu": 5e-4, "cpu_only": 1e-4}
FIRST_USE_STEM = "anelab_first_use"  # interface.first_use_package(): scripted as the tiny model it is
UNSTABLE_AFTER = 150  # a Mac lacking stateful_predicts_stable crashes at this stateful predict (#2716: ~100-200)


class FakeRuntime(CoreMLRuntime):
    """``CoreMLRuntime`` driven by a script; records ``calls``, ``loads``, ``compiles`` and ``released``."""

    name = "fake"
    load_description = "scripted fake of coremltools 9.0 (FakeClock seconds)"

    def __init__(
        self,
        functions: dict[str, FakeFunction] | None = None,
        *,
        default: FakeFunction | None = None,
        available: bool = True,
        reason: str = "fake runtime switched off",
        clock: FakeClock | None = None,
        machine: str = "arm64",
        neural_engine: bool = True,
        compile_s: float = 4.0,
        cache_dir: str | os.PathLike | None = None,
        log_dir: str | os.PathLike | None = None,
        real_crashes: bool = False,
        calls_file: str | os.PathLike | None = None,
        numerics: bool = False,
        import_s: float = 0.8,
        first_use_s: float = 0.3,
        lacks: frozenset[str] | set[str] = frozenset(),
        core_ml_first_use_s: float = 0.25,
        noise: dict[str, float] | None = None,
        chip: str = "Apple M4 (fake)",
        macos: str = "macOS 15.3 (fake)",
        probed: bool = True,
        core_ml_lines: str = "clear",
        versions_spawn_s: float = 0.004,
        first_use_on_ane: bool = True,
        plan_lists_every_function: bool = True,
        fp16_accumulation: bool = True,
    ):
        self.functions = dict(functions or {})
        self.default = default if default is not None else FakeFunction()
        self._available = available
        self._reason = reason
        self.clock = clock if clock is not None else FakeClock()
        self.machine, self.neural_engine, self.compile_s = machine, neural_engine, float(compile_s)
        own = Path(tempfile.gettempdir()) / f"anelab-fake-{uuid.uuid4().hex}"  # created when first written
        weakref.finalize(self, shutil.rmtree, own, True)  # and removed with the runtime (given dirs are the caller's)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else own / "compiled"
        self.log_dir = Path(log_dir) if log_dir is not None else own / "log"
        self.real_crashes = real_crashes
        self.numerics = numerics  # predict computes the saved program (NumPy), outputs fp32 as Core ML returns them
        self.import_s, self.first_use_s = float(import_s), float(first_use_s)
        self.lacks = frozenset(lacks)
        self.core_ml_first_use_s = float(core_ml_first_use_s)
        self.noise = dict(DEVICE_NOISE if noise is None else noise)
        self.chip, self.macos = chip, macos
        self.unified_log = FakeUnifiedLog(self.log_dir, core_ml_lines)
        self.versions_spawn_s = float(versions_spawn_s)
        self.plan_lists_every_function = bool(plan_lists_every_function)
        self.fp16_accumulation = bool(fp16_accumulation)  # ANE outputs carry fp16-accumulation noise of their width
        self.first_use_on_ane = bool(first_use_on_ane)  # False: the tiny first-use model's plan is all CPU
        self._imported = self._first_used = False  # this process's one-time work done (see prepare_process)
        self._core_ml_used = False  # this process's first modelWithContentsOfURL done
        self._stateful_predicts: dict[str, int] = {}  # per setting, this process
        self._predicts = 0
        self.first_use_calls: list[tuple] = []  # the tiny first-use model's calls (kept out of ``calls``)
        self._saved: dict = {}
        self.calls: list[tuple] = CallList(calls_file)
        self.loads: list[tuple[str, str, str]] = []  # (package path, function, compute units)
        self.compiles: list[str] = []  # package paths compiled (cache or per .mlpackage load)
        self.released: list[str] = []  # functions whose handle was released
        self._specialised: set[tuple[str, str, str]] = set()  # (compiled path, function, units) loaded before
        self._sources: dict[str, str] = {}  # compiled path -> package path
        if probed and not self.probe_file.is_file():
            self.seed_verdicts()

    @classmethod
    def from_args(cls, functions: dict, default: dict, **kwargs) -> FakeRuntime:
        """Rebuild from ``child_spec()`` args (in a child process)."""
        return cls(
            {k: FakeFunction.from_args(v) for k, v in functions.items()},
            default=FakeFunction.from_args(default),
            **kwargs,
        )

    def child_spec(self) -> dict:
        return {
            "factory": "anelab.runtimes.coreml.coreml_fake:FakeRuntime.from_args",
            "args": {
                "functions": {k: v.to_args() for k, v in self.functions.items()},
                "default": self.default.to_args(),
                "available": self._available,
                "reason": self._reason,
                "machine": self.machine,
                "neural_engine": self.neural_engine,
                "compile_s": self.compile_s,
                "cache_dir": str(self.cache_dir),
                "log_dir": str(self.log_dir),
                "real_crashes": True,
                "calls_file": str(self.log_dir / "child-calls.jsonl"),
                "numerics": self.numerics,
                "import_s": self.import_s,
                "first_use_s": self.first_use_s,
                "lacks": sorted(self.lacks),
                "core_ml_first_use_s": self.core_ml_first_use_s,
                "noise": self.noise,
                "chip": self.chip,
                "macos": self.macos,
                "core_ml_lines": self.unified_log.core_ml_lines,
                "versions_spawn_s": self.versions_spawn_s,
                "first_use_on_ane": self.first_use_on_ane,
                "plan_lists_every_function": self.plan_lists_every_function,
                "fp16_accumulation": self.fp16_accumulation,
                "probed": False,  # a child reads its parent's verdicts (spec_for_child names the file)
            },
        }

    # versions, verdicts, the probe, pre-flight ------------------------------------------------------
    def read_versions(self) -> dict[str, str]:
        """As costly as a Mac's: two ``sysctl`` spawns and one ``sw_vers`` (``machine_description``), each a real
        subprocess here and ``versions_spawn_s`` on the fake's clock."""
        from importlib.metadata import version

        for _ in range(3):
            subprocess.run(["true"], check=False)
            self.clock.advance(self.versions_spawn_s)
        return {"chip": self.chip, "macos": self.macos, "coremltools": version("coremltools")}

    def lacks_under(self, name: str, units: str | None = None) -> bool:
        """Whether this fake Mac breaks ``name`` (everywhere, or under ``units``; "all" breaks where either of
        the two settings it may use does)."""
        if name in self.lacks:
            return True
        settings = ("cpu_and_ne", "cpu_and_gpu") if units == "all" else (units,)
        return any(f"{name}@{u}" in self.lacks for u in settings if u)

    def expected_verdicts(self) -> dict:
        """What ``anelab doctor --probe`` finds on this fake Mac: every row passed under each of its settings,
        except what ``lacks`` breaks (a row that needs a failed one fails with it, as the probe records)."""

        table = {}
        for assumption in a.ASSUMPTIONS:
            units = {u: {"passed": not self.lacks_under(assumption.name, None if u == a.ANY_UNITS else u) and not (
                             assumption.name == a.CORE_ML_LOGS_FOR_CLIENT and self.unified_log.core_ml_lines in UNREADABLE_LINES),
                         "detail": "seeded by the fake (what the probe finds on it)"} for u in assumption.compute_units}  # fmt: skip
            table[assumption.name] = {
                "passed": all(v["passed"] for v in units.values()),
                "detail": "seeded",
                "units": units,
            }
        return table

    def seed_verdicts(self) -> None:
        """Write ``expected_verdicts`` as this fake Mac's probe file (what a probe run leaves)."""
        payload = {"assumptions": self.expected_verdicts(), "versions": self.versions(), "date": "seeded"}
        self.probe_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.probe_file.name}.", dir=self.probe_file.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, self.probe_file)  # as probe.write_verdicts writes it

    def probe_first(self, reason: str) -> None:

        probe_core_ml(self, reason=reason)

    def preflight(self, pkg, function, compute_units, steps) -> None:

        preflight(self, pkg, function, compute_units, steps)

    def handle_units(self, handle) -> str | None:
        return getattr(handle, "compute_units", None)

    def write_log_marker(self, text: str) -> None:
        """A line this process logs to the unified log (the probe's marker)."""
        self._log(text)

    def capture_native_output(self):

        if self.lacks_under(a.NATIVE_OUTPUT_ON_FDS):  # a Mac where swapping fds misses native writes
            import contextlib

            return contextlib.nullcontext(NativeOutput())
        return capture_native_output()

    def child_calls(self) -> list[tuple]:
        """The calls child processes made (e.g. the gate's), in order."""
        path = self.log_dir / "child-calls.jsonl"
        return [tuple(json.loads(line)) for line in path.read_text().splitlines()] if path.is_file() else []

    # availability ---------------------------------------------------------------------------------
    def available(self) -> bool:
        if self._available and not self._imported:  # the first check imports coremltools' native module
            self._imported = True
            self.clock.advance(self.import_s)
        return self._available

    def _first_use(self) -> None:
        """``_macos_version()``'s ``sw_vers`` subprocess, once per process (utils.py:959-968, lru-cached)."""
        if not self._first_used:
            self._first_used = True
            self.clock.advance(self.first_use_s)

    def prepare_process(self, compute_units="cpu_only"):
        self.require_available()
        self._first_use()
        steps = ["imported coremltools (fake: import_s)", "ran _macos_version() (fake: first_use_s)"]
        return steps + super().prepare_process(compute_units)[1:]

    def unavailable_reason(self) -> str:
        return "" if self._available else self._reason

    def neural_engine_reason(self) -> str:
        if not self._available:
            return self._reason
        if self.machine != "arm64":
            return f"no Neural Engine: this Mac is {self.machine}, not Apple silicon (arm64)"
        if not self.neural_engine:
            return "no Neural Engine: Core ML lists none among this Mac's compute devices"
        return ""

    # script ---------------------------------------------------------------------------------------
    def _source(self, path) -> str:
        return self._sources.get(str(Path(path)), str(path))

    def function_of(self, pkg, function: str | None) -> str:
        if function is not None:
            return function
        stem = Path(self._source(pkg)).stem
        return stem

    def script(self, name: str) -> FakeFunction:
        if name == FIRST_USE_STEM and name not in self.functions:  # a Mac may keep the tiny model on the CPU
            return FIRST_USE_SCRIPT if self.first_use_on_ane else FIRST_USE_ON_CPU
        return self.functions.get(name, self.default)

    def _calls_of(self, package) -> list:
        return self.first_use_calls if Path(str(package)).stem == FIRST_USE_STEM else self.calls

    def _functions_in(self, package: str) -> list[str]:
        """The functions the package's spec declares ([] for a stand-in directory without one)."""

        if not (Path(package) / "Data").is_dir():
            return []
        return list(function_signatures(package)[1])

    def _crash(self, signal_name: str, where: str) -> None:
        if self.real_crashes:
            os.kill(os.getpid(), getattr(signal, signal_name))
            time.sleep(5)  # the signal is delivered before this returns
        raise FakeCrash(signal_name, where)

    @staticmethod
    def _emit(fd: int, text: str) -> None:
        if text:
            os.write(fd, text.encode())

    def _log(self, text: str) -> None:
        self.unified_log.write(text)

    def read_unified_log(self, pid, start, end, helpers=()):

        if a.UNIFIED_LOG_READABLE in self.lacks:
            raise UnifiedLogUnavailable("'log show' did not finish within 120 s")
        return self.unified_log.read(pid, start, end, tuple(helpers))

    def signature(self, pkg, function):
        """Scripted (``FakeFunction.inputs``; fp16) or the package's spec; empty for a stand-in without one."""

        name = self.function_of(pkg, function)
        f = self.script(name)
        if f.inputs is not None:
            fp16 = lambda d: {k: (tuple(s), "float16") for k, s in (d or {}).items()}  # noqa: E731
            return FunctionSignature(fp16(f.inputs), fp16(f.states), fp16(f.output_shapes))
        if not (Path(self._source(pkg)) / "Data").is_dir():  # a scripted stand-in directory without a spec
            return FunctionSignature({}, {}, {})
        default, sigs = function_signatures(self._source(pkg))
        return sigs.get(name) or sigs[default]

    def _signature(self, name: str, package: str):
        """(inputs, states, outputs) name -> shape; None when nothing is declared (no checks then)."""
        sig = self.signature(package, name)
        if not (sig.inputs or sig.states or sig.outputs):
            return None
        shapes = lambda d: {k: tuple(s) for k, (s, _) in d.items()}  # noqa: E731
        return shapes(sig.inputs), shapes(sig.states), shapes(sig.outputs)

    # compile / load -------------------------------------------------------------------------------
    def compile_to(self, pkg, dest):

        source, target = str(pkg).rstrip("/"), str(dest).rstrip("/")
        if not source.endswith((".mlpackage", ".mlmodel")):  # utils.py:1098-1100, 1112-1119
            raise RuntimeLoadError(
                f"{pkg}: does not compile: Invalid model file path: '{pkg}'.Expected a file with .mlpackage or "
                f".model extension."
            )
        if not target.endswith(".mlmodelc"):  # utils.py:1134-1135
            raise RuntimeLoadError(
                f'{pkg}: does not compile: "destination_path" parameter must have ".mlmodelc" file extension.'
            )
        if not Path(pkg).is_dir():
            raise RuntimeLoadError(f"{pkg}: does not compile: no such package")
        if self.lacks_under(a.COMPILE_TO_MLMODELC):
            raise RuntimeLoadError(f"{pkg}: does not compile: compileModelAtURL failed (this fake Mac lacks it)")
        self._first_use()  # compile_model checks _macos_version() (utils.py:1103)
        self._calls_of(pkg).append(("compile", str(pkg)))
        if self._calls_of(pkg) is self.calls:
            self.compiles.append(str(pkg))
        self.clock.advance(self.compile_s)
        dest = Path(dest)
        dest.mkdir(parents=True)
        (dest / "coremldata.bin").write_text(str(Path(pkg).resolve()))
        self._sources[str(dest)] = str(pkg)
        return dest

    def compile(self, pkg):
        dest = super().compile(pkg)
        self._sources[str(dest)] = str(pkg)  # compiled by an earlier process: its source is this package
        return dest

    def _compiled_for_load(self, path: Path, function) -> tuple[Path, bool]:
        """(the .mlmodelc to load, whether it is a temporary copy of an .mlpackage, CoreMLPython.mm:457-466)."""
        if path.suffix != ".mlmodelc":  # coremltools compiles an .mlpackage on every construction, into a fresh copy
            if not path.is_dir():
                raise RuntimeLoadError(f"{path}: function {function or '(default)'} does not load: no such package")
            compiled = Path(tempfile.gettempdir()) / f"{path.stem}_{uuid.uuid4().hex.upper()}.mlmodelc"
            self.compile_to(path, compiled)
            self._sources[str(compiled)] = str(path)
            return compiled, True
        if not path.is_dir():
            raise RuntimeLoadError(f"{path}: does not load: not a compiled model directory")
        self._first_use()  # CompiledMLModel._init_check: _macos_version() (_compiled_model.py:34)
        return path, False

    def _resolve_function(self, package: str, function, compiled: Path) -> str:
        """The function a load gets: the named one; an unknown name is refused (configuration.functionName) —
        on a Mac lacking load_function_by_name it silently gets the default function instead."""

        name = self.function_of(compiled, function)
        declared = self._functions_in(package) if function is not None else []
        if declared and name not in declared:
            if self.lacks_under(a.LOAD_FUNCTION_BY_NAME):
                return declared[0]
            raise RuntimeLoadError(
                f"{package}: function {name} does not load: the model has no function named {name!r} "
                f"(it has {', '.join(declared)})"
            )
        return name

    def load_path(self, path, function, compute_units):

        check_compute_units(compute_units)
        self.require_available()
        compiled, temporary = self._compiled_for_load(Path(path), function)
        package = self._source(compiled)
        name = self._resolve_function(package, function, compiled)
        self._calls_of(package).append(("load", package, name, compute_units))
        f = self.script(name)
        self._emit(1, f.load_stdout)
        self._emit(2, f.load_stderr)
        self._log(f.log_text)
        self._core_ml_log(f"[coreml] loaded {Path(package).name} function {name} ({compute_units})")
        for fd, text in ((2, f.exit_stderr), (1, f.exit_stdout)):
            if text:
                atexit.register(self._emit, fd, text)
        if compute_units in NEURAL_ENGINE_UNITS and self.lacks_under(a.UNGATED_LOAD_AND_PLAN_SURVIVE, compute_units):
            self._crash("SIGKILL", f"load of {name} ({compute_units})")
        # the compile cache is keyed by path — on a Mac lacking fresh_copy_compiles_cold, by content
        where = package if self.lacks_under(a.FRESH_COPY_COMPILES_COLD, compute_units) else str(compiled)
        key = (where, name, compute_units)
        load_s = f.warm_load_s if key in self._specialised else f.cold_load_s
        if not self._core_ml_used:  # the process's first modelWithContentsOfURL (CoreMLPython.mm:500-503)
            self._core_ml_used = True
            load_s += self.core_ml_first_use_s
        self.clock.advance(load_s + f.load_call_s)
        self._specialised.add(key)
        if f.load_error is not None:
            raise RuntimeLoadError(f"{package}: function {name} does not load: {f.load_error}")
        if compute_units in f.unloadable_units:
            raise RuntimeLoadError(f"{package}: function {name} does not load under {compute_units}")
        if self._calls_of(package) is self.calls:
            self.loads.append((package, name, compute_units))
        handle = FakeHandle(self, package, compiled, name, compute_units, temporary)
        handle.load_s = load_s
        handle.merged = len(self._functions_in(package)) > 1
        return handle

    def _core_ml_log(self, text: str) -> None:
        """Core ML's own unified-log lines for this process (none on a Mac lacking them for the client's PID)."""

        if not self.lacks_under(a.CORE_ML_LOGS_FOR_CLIENT):
            self.unified_log.write_core_ml(text)

    def load_duration_s(self, handle):

        return None if self.lacks_under(a.CORE_ML_LOAD_DURATION, handle.compute_units) else handle.load_s

    def predict_duration_s(self, handle):

        return None if self.lacks_under(a.CORE_ML_PREDICT_DURATION, handle.compute_units) else handle.last_predict_s

    # predict --------------------------------------------------------------------------------------
    def make_state(self, handle):

        self.require_assumptions(a.STATE_BY_NAME, a.FRESH_STATE_ZEROED, compute_units=handle.compute_units)
        sig = self._signature(handle.function, handle.package)
        states = (sig[1] if sig else None) or self.script(handle.function).states or {}
        fill = np.ones if self.lacks_under(a.FRESH_STATE_ZEROED, handle.compute_units) else np.zeros
        state = FakeState({k: fill(s, np.float16) for k, s in states.items()})
        state.made_by = handle.function
        return state

    def _signal_fires(self, f: FakeFunction, handle) -> bool:
        if not f.predict_signal:
            return False
        if f.signal_units is not None and handle.compute_units not in f.signal_units:
            return False
        return getattr(handle, "merged", False) or not f.signal_when_merged

    def _crash_if_unstable(self, handle, state) -> None:
        """#2716: a Mac lacking stateful_predicts_stable dies at the UNSTABLE_AFTER-th stateful predict."""

        if state is None or not self.lacks_under(a.STATEFUL_PREDICTS_STABLE, handle.compute_units):
            return
        count = self._stateful_predicts.get(handle.compute_units, 0) + 1
        self._stateful_predicts[handle.compute_units] = count
        if count >= UNSTABLE_AFTER:
            self._crash("SIGSEGV", f"stateful predict {count} of {handle.function}")

    def predict(self, handle, inputs, state=None):
        self.require_available()
        name, units = handle.function, handle.compute_units
        self.require_assumptions(a.FP32_FEEDS_FP16_INPUTS, a.FP16_OUTPUTS_AS_FP32, compute_units=units)
        self._calls_of(handle.package).append(("predict", handle.package, name, units))
        f = self.script(name)
        if not isinstance(inputs, dict):  # model.py:878-884
            raise TypeError(f'"data" parameter must be either a dict or list of dict, but got {type(inputs)}.')
        fp16 = [k for k, v in inputs.items() if isinstance(v, np.ndarray) and v.dtype == np.float16]
        for k in fp16:  # coremltools: fp16 -> fp32 in the caller's dict (model.py:1064-1067)
            inputs[k] = inputs[k].astype(np.float32)
        if fp16:
            self.clock.advance(f.convert_s)
        self._refuse_unconvertible(inputs, units)
        self._emit(2, f.predict_stderr)
        self._core_ml_log(f"[coreml] predict {name} ({units})")
        if self._signal_fires(f, handle):
            self._crash(f.predict_signal, f"predict of {name} ({units})")
        self._crash_if_unstable(handle, state)
        sig = self._signature(name, handle.package)
        if sig is not None:
            check_predict_inputs(inputs, state, *sig, names_checked=handle.temporary)
        self._refuse_foreign_state(handle, state)
        if f.predict_error is not None:
            raise RuntimePredictError(f"predict failed: {f.predict_error}")
        handle.last_predict_s = f.predict_s.get(units, f.predict_default_s)
        self.clock.advance(handle.last_predict_s)  # Core ML's own prediction (CoreMLPython.mm:543-562)
        self.clock.advance(f.output_convert_s)  # outputs to NumPy, fp16 -> fp32 copies (CoreMLPythonUtils.mm:448-484)
        if f.outputs:
            return dict(f.outputs)
        if self.numerics:
            if self.lacks_under(a.INT32_INPUTS_ACCEPTED, units):  # the value does not reach the graph: read as 0
                inputs = {
                    k: np.zeros_like(v) if getattr(v, "dtype", None) == np.int32 else v for k, v in inputs.items()
                }
            return self._as_returned(self._compute(handle.package, name, inputs, state), name, units)
        return {k: np.zeros(s, np.float32) for k, s in (sig[2] if sig else {}).items()}

    def _as_returned(self, outputs: dict, name: str, units: str) -> dict:
        """The device's outputs: the program's values with fp16-sized relative noise of this setting, fp32
        (fp16 on a Mac lacking fp16_outputs_come_back_as_fp32). The noise is a function of the values (a device
        rounds the same inputs the same way): a repeated predict gives the same output."""
        self._predicts += 1
        seen = zlib.crc32(b"".join(np.ascontiguousarray(v, np.float32).tobytes() for v in outputs.values()))
        rng = np.random.default_rng([seen, len(name), sum(map(ord, units))])
        scale = self.noise.get(units, 0.0)
        if units in NEURAL_ENGINE_UNITS and self.fp16_accumulation:  # the ANE's fp16 accumulation over the row width
            scale = max(scale, fp16_accumulation_error(max(np.shape(v)[-1] for v in outputs.values())))
        dtype = np.float16 if self.lacks_under(a.FP16_OUTPUTS_AS_FP32, units) else np.float32
        return {k: (v * (1 + scale * rng.standard_normal(v.shape))).astype(dtype) for k, v in outputs.items()}

    def _refuse_unconvertible(self, inputs: dict, units: str) -> None:
        """int32 / fp32 / fp64 writable arrays only (CoreMLPythonArray.mm:10-31, 55); anything else is printed
        to stdout and refused (CoreMLPythonUtils.mm:397-409), as MacRuntime.predict reports it. A Mac lacking one
        of the dtype assumptions under ``units`` behaves the other way (lacking int32_arrays_accepted: an int32
        value does not reach the graph, see ``predict``)."""

        accepted = {("i", 4): True, ("f", 4): not self.lacks_under(a.FP32_FEEDS_FP16_INPUTS, units), ("f", 8): True,
                    ("i", 8): self.lacks_under(a.UNSUPPORTED_DTYPE_REFUSED, units)}  # fmt: skip
        read_only_passes = self.lacks_under(a.READ_ONLY_REFUSED, units)
        for value in inputs.values():
            if not isinstance(value, np.ndarray):
                continue
            supported = accepted.get((value.dtype.kind, value.dtype.itemsize), False)
            if not supported or not (value.flags.writeable or read_only_passes):
                print("Error: value type not convertible:")
                print(value)
                raise RuntimePredictError("predict failed: value type not convertible")

    def _refuse_foreign_state(self, handle, state) -> None:
        """A Mac that lacks ``one_state_shared_by_two_functions`` refuses a state another function's handle made."""

        made_by = getattr(state, "made_by", None)
        if self.lacks_under(a.STATE_SHARED_BY_FUNCTIONS, handle.compute_units) and made_by not in (
            None,
            handle.function,
        ):
            raise RuntimePredictError(
                f'predict failed: {{ NSLocalizedDescription = "The state was created by function {made_by}, '
                f'not {handle.function}."; }}'
            )

    def _compute(self, package: str, name: str, inputs: dict, state) -> dict:
        """What the saved program computes (NumPy), as Core ML hands it back: fp32 copies."""

        if package not in self._saved:
            self._saved[package] = SavedPackage(package)
        saved = self._saved[package]
        name = name if name in saved.functions else saved.default_function  # a variant's stem names "main"
        declared = self.signature(package, name)
        typed = {k: np.asarray(v).astype(declared.inputs[k][1]) for k, v in inputs.items()}  # Core ML casts back
        if state is None:
            out = evaluate(saved, name, typed)
        else:
            out = evaluate_with_state(saved, name, typed, state)
        return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}

    # compute plan ---------------------------------------------------------------------------------
    def plan_path(self, compiled, compute_units, function=None):
        """The default function's plan of a single-function package; of a merged one, the function asked — and, with
        no function asked, every function's operations summed (``plan_lists_every_function``; as a plan that lists
        the whole program would be counted)."""
        check_compute_units(compute_units)
        self.require_available()
        compiled = Path(compiled)
        if compiled.suffix != ".mlmodelc":  # coremltools 9.0 #2757: libc++abi terminate, SIGABRT
            self._crash("SIGABRT", f"MLComputePlan.load_from_path({compiled.name})")

        if self.lacks_under(a.COMPUTE_PLAN_OF_COMPILED, compute_units):
            raise RuntimeError("MLComputePlan: the plan could not be loaded (this fake Mac lacks it)")
        if compute_units in NEURAL_ENGINE_UNITS and self.lacks_under(a.UNGATED_LOAD_AND_PLAN_SURVIVE, compute_units):
            self._crash("SIGKILL", f"MLComputePlan.load_from_path({compiled.name}, {compute_units})")
        source = self._source(compiled)
        declared = self._functions_in(source)
        if len(declared) > 1:
            names = [function] if function in declared else declared if self.plan_lists_every_function else declared[:1]
        else:  # a single-function variant is named by its stem
            names = [self.function_of(compiled, None)]
        self._calls_of(source).append(("compute_plan", source, names[0], compute_units))
        counts = {key: 0 for key in ASSIGNMENT_KEYS}
        for name in names:
            for key, value in self._function_plan(name, compute_units, merged=len(declared) > 1).items():
                counts[key] += value
        counts["total"] = counts["neural_engine"] + counts["gpu"] + counts["cpu"]
        return counts

    def _function_plan(self, name: str, compute_units: str, *, merged: bool) -> dict[str, int]:

        f = self.script(name)
        self._emit(2, f.plan_stderr)
        if f.plan_error is not None:
            raise RuntimeError(f.plan_error)
        counts = {key: 0 for key in ASSIGNMENT_KEYS if key != "total"}
        for key, value in (f.assignment or {}).items():
            if key not in counts:
                raise ValueError(f"FakeFunction.assignment key {key!r}; use neural_engine, gpu, cpu, unreported")
            counts[key] = int(value)
        if merged and self.lacks_under(a.MERGED_LIKE_VARIANT, compute_units):  # merged: nothing on the ANE
            counts["cpu"] += counts["neural_engine"]
            counts["neural_engine"] = 0
        if "compute_ops" not in (f.assignment or {}):  # default: the block's compute ops go where most of it goes
            counts["compute_ops"] = f.compute_ops
            on_ane = f.compute_ops if f.compute_ops_on_ane is None else f.compute_ops_on_ane
            counts["compute_ops_on_neural_engine"] = on_ane if counts["neural_engine"] else 0
        return counts
