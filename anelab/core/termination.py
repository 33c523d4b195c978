"""SIGTERM as an exception that every ``finally`` sees, and that a library's bare ``except:`` cannot swallow.

The default action of SIGTERM ends the process on the spot, leaving an export's staging folder and its
workers behind. ``terminate_by_exception`` makes SIGTERM raise ``Terminated`` wherever the main thread is,
so clean-up runs. A signal that lands inside third-party code can be caught there (coremltools' optional
imports use bare ``except:``), so the signal is also remembered, and ``raise_if_terminated`` (called
between the units of long work: each layer, before a commit) raises it again.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Terminated(BaseException):
    """SIGTERM received: the process is ending; raised so that every ``finally`` runs."""


_received = False


def _on_sigterm(signum, frame) -> None:
    global _received
    _received = True
    raise Terminated()


def raise_if_terminated() -> None:
    """Raise ``Terminated`` if SIGTERM came while ``terminate_by_exception`` was active (even if the first
    raise was swallowed by the code it interrupted)."""
    if _received:
        raise Terminated()


@contextlib.contextmanager
def terminate_by_exception() -> Iterator[None]:
    """Within this block (on the main thread; elsewhere it does nothing), SIGTERM raises ``Terminated``."""
    global _received
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received = False
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _received = False
