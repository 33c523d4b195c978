"""The fake Mac's unified log: per-process files that ``read_unified_log`` reads back, as unkind as macOS's.

Apple's frameworks log their arguments as ``<private>`` unless a profile says otherwise, info lines are often not
persisted, and the Neural Engine compiler's own lines come from its helper processes (``ANECompilerService``,
``aned``), not from the client whose model they compile. ``core_ml_lines`` chooses which of these the fake's
Core ML lines meet:

- ``clear``: every line persisted under the client's PID, unredacted;
- ``one_redacted``: as ``clear``, except the process's first Core ML line reads ``<private>``;
- ``redacted``: every Core ML line's arguments read ``<private>`` (the static prefix stays);
- ``missing``: no Core ML line is persisted at all;
- ``helper``: Core ML's lines are logged by a helper process (``HELPER_PROCESS``), not under the client's PID.

Lines a process logs itself (``write``: the probe's marker, a function's scripted ``log_text``) are always kept.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

CORE_ML_LINES = ("clear", "one_redacted", "redacted", "missing", "helper")
UNREADABLE_LINES = ("redacted", "missing")  # where no Core ML line can be read: the probe's log row fails
HELPER_PROCESS = "ANECompilerService"  # what the helper lines' file is called (a process name, not a PID)
REDACTED = "<private>"


class FakeUnifiedLog:
    """Per-process log files under ``log_dir`` (``<pid>.log``, and ``ANECompilerService.log`` for helper lines)."""

    def __init__(self, log_dir: Path, core_ml_lines: str = "clear"):
        if core_ml_lines not in CORE_ML_LINES:
            raise ValueError(f"core_ml_lines {core_ml_lines!r}; use one of {', '.join(CORE_ML_LINES)}")
        self.log_dir, self.core_ml_lines = Path(log_dir), core_ml_lines
        self._core_ml_written = 0

    def _append(self, who: str, text: str) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{who}.log", "a") as f:
            for line in text.splitlines():
                f.write(f"{time.time():.6f}\t{line}\n")

    def write(self, text: str) -> None:
        """A line this process logs itself (kept whatever ``core_ml_lines`` says)."""
        if text:
            self._append(str(os.getpid()), text)

    def write_core_ml(self, text: str) -> None:
        """One of Core ML's own lines about this process's work, as ``core_ml_lines`` has macOS keep it."""
        self._core_ml_written += 1
        mode = self.core_ml_lines
        if mode == "missing":
            return
        if mode == "redacted" or (mode == "one_redacted" and self._core_ml_written == 1):
            prefix = text.split("]", 1)[0] + "]" if text.startswith("[") else ""
            text = f"{prefix} {REDACTED}".strip()
        self._append(HELPER_PROCESS if mode == "helper" else str(os.getpid()), text)

    def read(self, pid: int, start: float, end: float, helpers: tuple[str, ...] = ()) -> str:
        """The lines of ``pid`` (and of the helper processes named in ``helpers``) between two stamps."""
        lines = []
        for who in (str(int(pid)), *helpers):
            path = self.log_dir / f"{who}.log"
            if not path.is_file():
                continue
            for row in path.read_text().splitlines():
                stamp, _, text = row.partition("\t")
                if start - 1 <= float(stamp) <= end + 1:
                    lines.append((float(stamp), text if who == str(int(pid)) else f"{who}: {text}"))
        return "\n".join(text for _, text in sorted(lines, key=lambda x: x[0]))
