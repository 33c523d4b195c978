"""One way to run a step of anelab in a fresh Python process: the gate's, the probe's, the timing's and Core AI's
children all start here, get their request as JSON on stdin and are read back the same way.

A child is the process that may die (a first Neural Engine predict can kill it, apple/coremltools#2758; Core AI
has been seen to abort at exit), so the parent keeps everything it needs to say how it ended: its exit status
(``CHILD_TIMED_OUT`` when stopped for not finishing), its PID and lifetime (for its unified log), both streams,
and — for a child that answers — the last ``ANSWER_PREFIX`` line of its stdout, whatever Core ML printed around it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from anelab.core.paths import REPO_ROOT
from anelab.runtimes.interface import CHILD_TIMED_OUT

ANSWER_PREFIX = "anelab-child-answer: "  # the line of a child's stdout that is its answer (Core ML may print more)


@dataclass
class ChildRun:
    """How one child ended: exit status, streams, PID and its lifetime on ``time.time()``."""

    returncode: int
    stdout: str
    stderr: str
    pid: int
    start: float
    end: float
    events: list[dict] = field(default_factory=list)  # what the child appended to its result file, if any

    def stderr_tail(self, width: int = 160) -> str:
        return (self.stderr.strip().splitlines() or ["no output"])[-1][:width]


def child_env() -> dict:
    """This environment, with the repository on the child's ``PYTHONPATH`` (a checkout runs without an install)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def run_child(entry: str, request: dict, timeout: float) -> ChildRun:
    """Run ``entry`` (``"module:function"``) in a new Python process with ``request`` as JSON on its stdin."""
    module, _, function = entry.partition(":")
    start = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-c", f"from {module} import {function}; {function}()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
    )  # fmt: skip
    try:
        out, err = proc.communicate(json.dumps(request), timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        code = CHILD_TIMED_OUT
    return ChildRun(code, out, err, proc.pid, start, time.time())


def write_answer(answer: dict) -> None:
    """A child's JSON answer on its own line of stdout, after ``ANSWER_PREFIX`` (flushed: an abort at exit keeps it)."""
    sys.stdout.write("\n" + ANSWER_PREFIX + json.dumps(answer) + "\n")
    sys.stdout.flush()


def read_answer(stdout: str) -> tuple[dict | None, str]:
    """(the child's answer, "") or (None, one line saying why there is none) from its whole stdout: the last
    ``ANSWER_PREFIX`` line, whatever Core ML printed before or after it (e.g. at exit)."""
    lines = [line for line in stdout.splitlines() if line.startswith(ANSWER_PREFIX)]
    if not lines:
        last = (stdout.strip().splitlines() or ["nothing"])[-1][:120]
        return None, f"no answer line on its stdout (its last line: {last!r})"
    try:
        answer = json.loads(lines[-1][len(ANSWER_PREFIX) :])
    except ValueError as e:
        return None, f"its answer line is not JSON ({e})"
    if not isinstance(answer, dict):
        return None, f"its answer is a {type(answer).__name__}, not an object"
    return answer, ""
