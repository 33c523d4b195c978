"""The macOS Core ML runtime's interface: what anelab asks of Core ML, and its errors."""

from __future__ import annotations

import abc
import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from anelab.errors import AnelabInputError

COMPUTE_UNITS = frozenset({"cpu_only", "cpu_and_gpu", "cpu_and_ne", "all"})


# compute-units settings that ask for the Neural Engine (a sidecar must be ANE-verified for these)
NEURAL_ENGINE_UNITS = frozenset({"cpu_and_ne", "all"})


MIN_MACOS = (15, 0)  # multifunction mlprograms with fp16 I/O target macOS 15 / iOS 18


# keys of compute_plan_assignment(): operations per PREFERRED device, plus operations the plan
# lists without a device usage ("unreported"); total = neural_engine + gpu + cpu
ASSIGNMENT_KEYS = ("neural_engine", "gpu", "cpu", "unreported", "total")


class RuntimeUnavailableError(AnelabInputError):
    """The Core ML runtime is not available here (not macOS 15+, or coremltools' native module missing)."""


class RuntimeLoadError(RuntimeError):
    """A package function did not load (the framework's own error is in the message)."""


def check_compute_units(name: str) -> str:
    """Return ``name`` if it is a compute-units setting; refuse an unknown one listing the valid ones."""
    if name not in COMPUTE_UNITS:
        raise AnelabInputError(f"unknown compute units {name!r}; use one of {', '.join(sorted(COMPUTE_UNITS))}")
    return name


def empty_assignment() -> dict[str, int]:
    return {key: 0 for key in ASSIGNMENT_KEYS}


@dataclass
class NativeStderr:
    """What was written to file descriptor 2 inside ``capture_native_stderr`` (set on exit)."""

    text: str = ""


@contextlib.contextmanager
def capture_native_stderr() -> Iterator[NativeStderr]:
    """Capture everything written to file descriptor 2 — by C/Objective-C code too, not only ``sys.stderr``.

    Core ML reports an ANE compile refusal on the process's native stderr and returns normally, so
    redirecting ``sys.stderr`` would miss it. fd 2 is pointed at a temporary file with ``os.dup2``
    for the duration and restored afterwards; ``.text`` holds the captured text after the block.
    """
    captured = NativeStderr()
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            for stream in (sys.stderr, sys.__stderr__):
                with contextlib.suppress(Exception):
                    stream.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.text = sink.read().decode("utf-8", errors="replace")


class CoreMLRuntime(abc.ABC):
    """Load, predict and compute-plan queries for sidecar packages."""

    name = "abstract"
    load_description = "abstract"  # what one load() does, recorded with load timings

    @abc.abstractmethod
    def available(self) -> bool:
        """Whether this runtime can load and run packages on this machine."""

    @abc.abstractmethod
    def unavailable_reason(self) -> str:
        """Why ``available()`` is False (one line naming what is missing); "" when available."""

    @abc.abstractmethod
    def load(self, pkg: str | os.PathLike, function: str | None, compute_units: str) -> Any:
        """Load one function of a package (``None``: the package's default function); return a handle.

        Raises ``RuntimeLoadError`` when the function does not load.
        """

    @abc.abstractmethod
    def predict(self, handle: Any, inputs: dict) -> dict:
        """Run a loaded function on ``inputs`` (name -> array) and return its outputs (name -> array)."""

    @abc.abstractmethod
    def compute_plan_assignment(self, pkg: str | os.PathLike, compute_units: str) -> dict[str, int]:
        """Operations of the package's program per preferred compute device (keys: ``ASSIGNMENT_KEYS``).

        Counts the device the plan PREFERS for each operation, not the devices that merely support
        it. Core ML reports usage only for a package's default function, so a non-default function
        of a multifunction package reports nothing (total 0).
        """

    def capture_native_stderr(self) -> contextlib.AbstractContextManager[NativeStderr]:
        """fd-level capture of native stderr (see ``capture_native_stderr``)."""
        return capture_native_stderr()

    def require_available(self) -> None:
        """Raise ``RuntimeUnavailableError`` (one line, the reason) unless ``available()``."""
        if not self.available():
            raise RuntimeUnavailableError(self.unavailable_reason())
