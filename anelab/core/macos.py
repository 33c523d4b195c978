"""This Mac's macOS version, read as coremltools reads it: ``sw_vers -productVersion``, once per process.

``platform.mac_ver()`` reads ``SystemVersion.plist`` through the process's SDK view: a Python built against an
older SDK runs in compatibility mode and is told "16.0" on macOS 26 and later (python/cpython#135675), so a
Core AI runtime would be refused on a macOS 27 Mac and records would carry the wrong OS. ``sw_vers`` (what
coremltools 9.0 ``models/utils.py:959-968`` runs, lru-cached) answers with the system's own version.
"""

from __future__ import annotations

import functools
import subprocess
import sys

SW_VERS = ("sw_vers", "-productVersion")
SW_VERS_TIMEOUT_S = 10.0


def parse_version(text: str) -> tuple[int, ...]:
    """ "26.1" -> (26, 1); () for text that is not a dotted version."""
    try:
        return tuple(int(x) for x in text.strip().split(".")) if text.strip() else ()
    except ValueError:
        return ()


@functools.lru_cache(maxsize=1)
def macos_version() -> tuple[int, ...]:
    """This Mac's macOS version from ``sw_vers -productVersion`` (one subprocess per process); () off macOS or
    when ``sw_vers`` does not answer."""
    if sys.platform != "darwin":
        return ()
    try:
        done = subprocess.run(SW_VERS, capture_output=True, text=True, timeout=SW_VERS_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return ()
    return parse_version(done.stdout) if done.returncode == 0 else ()


def macos_version_text() -> str:
    """``macos_version()`` as "26.1" ("unknown" when it could not be read)."""
    return ".".join(map(str, macos_version())) or "unknown"
