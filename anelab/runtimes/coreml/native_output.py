"""Everything native code writes to file descriptors 1 and 2, captured (Core ML reports ANE compiler failures there
while the call returns normally)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class NativeOutput:
    """What was written to file descriptors 1 and 2 inside ``capture_native_output`` (set on exit)."""

    stdout: str = ""
    stderr: str = ""

    @property
    def text(self) -> str:
        """Both streams, stderr first (where Core ML's ANE compiler messages usually are)."""
        return "\n".join(part for part in (self.stderr, self.stdout) if part)


def _flush_all() -> None:
    """Flush Python's streams and every C stdio buffer (``fflush(NULL)``), so no byte crosses the swap."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def capture_native_output() -> Iterator[NativeOutput]:
    """Capture everything written to file descriptors 1 and 2 — by C/Objective-C code too.

    Core ML reports ANE compiler failures on the process's native stdout or stderr while the call
    returns normally, so redirecting ``sys.stdout``/``sys.stderr`` would miss them. Both fds are
    pointed at temporary files with ``os.dup2``; C stdio buffers are flushed (libc ``fflush``)
    before the fds are restored. Messages Core ML prints only at process exit, or only to the
    unified log, are not seen here: run the call in a child process (``anelab.runtimes.coreml.gate``).
    """
    captured = NativeOutput()
    _flush_all()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    sinks = {fd: tempfile.TemporaryFile(mode="w+b") for fd in (1, 2)}
    try:
        for fd, sink in sinks.items():
            os.dup2(sink.fileno(), fd)
        try:
            yield captured
        finally:
            _flush_all()
            for fd, old in saved.items():
                os.dup2(old, fd)
            texts = {}
            for fd, sink in sinks.items():
                sink.seek(0)
                texts[fd] = sink.read().decode("utf-8", errors="replace")
            captured.stdout, captured.stderr = texts[1], texts[2]
    finally:
        for fd in saved.values():
            os.close(fd)
        for sink in sinks.values():
            sink.close()
