"""coreai-core's bundled CPU runtime, run in a child process that serves one saved asset.

Why a child: a process that has run the 1.0.0b3 runtime aborts at exit about one time in six
("C++ exception handling detected but the Swift runtime was compiled with exceptions disabled",
SIGABRT after the program's last line; seen with Apple's own tutorial pattern, 2 of 12 runs), and a
bad call can end it with a Swift ``Fatal error``. The child opens the asset once
(``AIModelAsset.executable()``: on Linux the asset is compiled to ODIX in a temporary ``.aimodelx``),
answers calls over a pipe (pickled NumPy arrays), releases the model when asked, and is then killed,
so its exit never runs; the caller's process (a test, a notebook, the CLI) never loads the runtime.
A child that dies mid-call is reported in one line with the last line it wrote on stderr.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.core.paths import REPO_ROOT
from anelab.sidecar.coreai.coreai_import import coreai_modules

CHILD_ENTRY = "from anelab.sidecar.coreai.cpu_runtime import serve; serve()"
CLOSE_TIMEOUT_S = 60.0


def _send(stream, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream):
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the Core AI runtime process closed its pipe")
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


class CpuRuntimeProcess:
    """A child process holding one asset open on the CPU runtime: ``call`` runs one entrypoint, ``states``
    describes an entrypoint's states, ``close`` releases the model and kills the child."""

    def __init__(self, path: Path):

        self.path = Path(path)
        self.log = tempfile.TemporaryFile(mode="w+b")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        }
        self.child = subprocess.Popen(
            [sys.executable, "-c", CHILD_ENTRY, str(self.path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
        )  # fmt: skip
        self._ask(("open",))

    def _ask(self, message):
        try:
            _send(self.child.stdin, message)
            answer = _receive(self.child.stdout)
        except (BrokenPipeError, EOFError, OSError):
            self.child.wait(timeout=CLOSE_TIMEOUT_S)
            raise RuntimeError(
                f"the Core AI CPU runtime process serving {self.path.name} died (exit status {self.child.returncode}): "
                f"{self._last_log_line()}"
            ) from None
        if answer[0] == "error":
            kind, text = answer[1], answer[2]
            raise (AnelabInputError if kind == "input" else RuntimeError)(text)
        return answer[1]

    def _last_log_line(self) -> str:
        self.log.seek(0)
        lines = [line for line in self.log.read().decode("utf-8", errors="replace").splitlines() if line.strip()]
        useful = [line for line in lines if not line.startswith("ODIE [")]
        return (useful or lines or ["no output"])[-1][:300]

    def call(self, function: str, feed: dict, state: dict | None):
        """(outputs, states after the call) of one entrypoint on ``feed`` (and ``state``: name -> array)."""
        return self._ask(("call", function, feed, state))

    def states(self, function: str) -> dict:
        """name -> (shape, dtype) of the entrypoint's states (its loaded descriptor)."""
        return self._ask(("states", function))

    def close(self) -> None:
        if self.child.poll() is None:
            try:
                self._ask(("close",))
            except RuntimeError:
                pass
            self.child.kill()  # before its exit runs (module docstring)
        self.child.wait(timeout=CLOSE_TIMEOUT_S)
        for stream in (self.child.stdin, self.child.stdout):
            if stream is not None:
                stream.close()
        self.log.close()


# ---- the child ----------------------------------------------------------------------------------------------
def serve() -> None:
    """The child's loop: open the asset named by argv[1], answer calls until asked to close."""
    import asyncio

    import numpy as np

    protocol = os.fdopen(os.dup(1), "wb")  # answers go here; anything written on fd 1 goes to stderr
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    ca = coreai_modules()
    loop = asyncio.new_event_loop()
    context, model, functions = ca.authoring.AIModelAsset.load(sys.argv[1]).executable(), None, {}

    def function(name):
        if name not in functions:
            functions[name] = model.load_function(name)
        return functions[name]

    async def call(name, feed, state):
        arrays = {k: ca.runtime.NDArray(np.ascontiguousarray(v)) for k, v in feed.items()}
        states = {k: ca.runtime.NDArray(np.ascontiguousarray(v)) for k, v in (state or {}).items()}
        out = await function(name)(arrays, state=states)
        return {k: np.array(v.numpy()) for k, v in out.items()}, {k: np.array(v.numpy()) for k, v in states.items()}

    while True:
        message = _receive(requests)
        try:
            if message[0] == "open":
                model = loop.run_until_complete(context.__aenter__())
                answer = ("ok", None)
            elif message[0] == "call":
                answer = ("ok", loop.run_until_complete(call(*message[1:])))
            elif message[0] == "states":
                desc = function(message[1]).desc
                shapes = {n: (tuple(int(s) for s in desc.state_descriptor(n).shape), str(desc.state_descriptor(n).dtype))
                          for n in desc.state_names}  # fmt: skip
                answer = ("ok", shapes)
            else:  # close: release the model (and its temporary compiled copy), then wait to be killed
                functions.clear()
                model = None
                loop.run_until_complete(context.__aexit__(None, None, None))
                answer = ("ok", None)
        except KeyError as e:
            answer = ("error", "input", f"{Path(sys.argv[1]).name}: {e.args[0] if e.args else e}")
        except Exception as e:  # the runtime's refusal, reported in the caller as one line
            answer = ("error", "runtime", f"Core AI CPU runtime: {type(e).__name__}: {e}")
        _send(protocol, answer)
