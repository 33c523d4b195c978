"""Independent jobs on the machine's cores: how many may run at once, and a process pool that runs them.

Exporting and verifying one layer's sidecar are independent of every other layer's, and mostly
single-threaded Python (coremltools' pass pipeline, the MIL interpreter's op loop): ``process_map``
runs them in worker processes, each with ``threads_per_run`` BLAS threads so that workers x threads
never exceed the cores. Results come back in the order of the items, whatever order they finish in;
an exception in a worker is raised in the caller (an ``AnelabInputError`` keeps its one line), after
every other job is cancelled and every worker has exited; workers die with their parent.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from anelab.core.errors import AnelabInputError
from anelab.core.termination import raise_if_terminated

Item = TypeVar("Item")
Result = TypeVar("Result")

THREAD_CAP_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
DEFAULT_MAX_JOBS = 2  # per-layer work holds one layer's weights and activations (~1.2 GB at 1B size)


def available_cores() -> int:
    """CPU cores this process may use (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def threads_per_run(jobs: int, cores: int | None = None) -> int:
    """BLAS threads for each of ``jobs`` concurrent runs so that jobs x threads <= cores.

    ``jobs`` must lie in 1..cores (refused in one line otherwise)."""
    cores = available_cores() if cores is None else cores
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise AnelabInputError(f"--jobs must be at least 1, got {jobs}")
    if jobs > cores:
        raise AnelabInputError(f"--jobs {jobs} exceeds the {cores} cores here; use --jobs {cores} or fewer")
    return cores // jobs


CORE_BUDGET_VARIABLE = "ANELAB_CORES"  # cores a run may fill with its own workers (set for each of reproduce's runs)


def core_budget() -> int:
    """The cores this run's own worker pools may fill: ``available_cores``, or fewer where the run was given a share
    of them (``CORE_BUDGET_VARIABLE``: ``reproduce`` runs two notebooks at once on two cores, one core each, so a
    notebook's export does not fork workers onto the other's core). Unset or empty: every core; a share above the
    cores is the cores; anything but a whole number >= 1 is refused in one line."""
    cores = available_cores()
    value = os.environ.get(CORE_BUDGET_VARIABLE, "").strip()
    if not value:
        return cores
    if not value.isdigit() or int(value) < 1:
        raise AnelabInputError(
            f"{CORE_BUDGET_VARIABLE}={value!r} is not a number of cores; set it to 1..{cores} or unset it"
        )
    return min(cores, int(value))


def default_jobs(items: int, cores: int | None = None) -> int:
    """Workers for ``items`` independent per-layer jobs: at most the run's cores (``core_budget``), the items and
    ``DEFAULT_MAX_JOBS``."""
    cores = core_budget() if cores is None else cores
    return max(1, min(cores, items, DEFAULT_MAX_JOBS))


def _limit_threads(threads: int) -> None:
    """In a worker: cap BLAS (and the interpreter's tile threads, which read the same variables) at ``threads``."""
    from threadpoolctl import threadpool_limits

    for name in THREAD_CAP_VARIABLES:
        os.environ[name] = str(threads)
    threadpool_limits(limits=threads, user_api="blas")


_FDS_WORKERS_CLOSE: set[int] = set()


def keep_from_workers(fd: int) -> None:
    """Have each worker forked from now on close ``fd`` as it starts: a lock the parent holds (an ``flock``
    belongs to the open file, which a fork shares) must end with the parent, not with its last worker."""
    _FDS_WORKERS_CLOSE.add(fd)


def forget_kept_fd(fd: int) -> None:
    _FDS_WORKERS_CLOSE.discard(fd)


PARENT_POLL_SECONDS = 0.5  # how often a worker checks that the process that started it is still there


def _start_worker(threads: int, parent: int, nice: int = 0) -> None:
    """A worker's first step: its share of the BLAS threads; Ctrl-C left to the parent (which stops every
    worker itself: a terminal sends SIGINT to the whole group, and a worker that raised KeyboardInterrupt
    mid-layer would report a half-done job); death with the parent, however the parent ends; and what it
    inherited frozen (``gc.freeze``): the parent's objects (its imported modules, an opened checkpoint) stay
    alive in the worker anyway, and a full garbage collection then walks only what the worker made (coremltools'
    ``convert`` ends with one: ~0.09 s each over an inherited heap with coremltools imported, 4 per layer)."""
    gc.freeze()
    if nice:
        os.nice(nice)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # held by the parent when it forked
    for fd in list(_FDS_WORKERS_CLOSE):
        with contextlib.suppress(OSError):
            os.close(fd)
    _limit_threads(threads)
    _die_with_parent(parent)


def _die_with_parent(parent: int) -> None:
    """End this worker when ``parent`` is gone (even after SIGKILL): the kernel's parent-death signal on Linux,
    and everywhere a daemon thread that polls the parent's pid (a worker's parent becomes PID 1 or a reaper)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent ended before the signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="anelab-parent-watch", daemon=True).start()


def _stop_workers(pool) -> None:
    """Cancel what is queued and end the running workers now (SIGTERM, then SIGKILL after a grace), waiting
    until each has exited: nothing a worker writes can land after this returns."""
    processes = list(getattr(pool, "_processes", {}).values())  # the pool's worker processes (CPython)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        with contextlib.suppress(Exception):
            process.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in processes:
        with contextlib.suppress(Exception):
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()


STOP_GRACE_SECONDS = 5.0  # a terminated worker gets this long to exit before SIGKILL


def process_map(
    function: Callable[[Item], Result],
    items: Iterable[Item],
    *,
    jobs: int,
    on_result: Callable[[Item, Result], None] | None = None,
) -> list[Result]:
    """``[function(item) for item in items]`` on ``jobs`` worker processes (in this process when jobs is 1).

    ``function`` must be a module-level function and items and results picklable. ``on_result(item,
    result)`` is called in this process as each finishes (a progress bar's update). Workers are forked off macOS
    (``start_method``): they inherit the imported modules, so a worker starts in milliseconds, not coremltools'
    import time; on macOS they are spawned. All or nothing: the first exception (a worker's, or KeyboardInterrupt
    / a signal's in this process) cancels what is queued, ends the running workers and is raised here once they
    have exited; workers ignore Ctrl-C (this process stops them) and die with this process whatever ends it.
    """
    items = list(items)
    threads = threads_per_run(jobs)
    if jobs == 1 or len(items) <= 1:
        results = []
        for item in items:
            raise_if_terminated()  # a SIGTERM swallowed by the last item's library code ends the run here
            results.append(function(item))
            if on_result is not None:
                on_result(item, results[-1])
        return results
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from multiprocessing import get_context

    done: dict[int, Result] = {}
    context = get_context(start_method())
    # Ctrl-C and SIGTERM are held while the pool runs (its threads and workers start with them held) and let in
    # only between waits, so they interrupt this loop, never concurrent.futures' own locks.
    unheld = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        pool = ProcessPoolExecutor(jobs, mp_context=context, initializer=_start_worker, initargs=(threads, os.getpid()))
        try:
            futures = {pool.submit(function, item): index for index, item in enumerate(items)}
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, timeout=SIGNAL_POLL_SECONDS, return_when=FIRST_COMPLETED)
                signal.pthread_sigmask(signal.SIG_SETMASK, unheld)  # a signal that came meanwhile is raised here
                signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
                raise_if_terminated()
                for future in sorted(finished, key=futures.get):
                    index = futures[future]
                    done[index] = future.result()  # a worker's exception is raised here, in the caller
                    if on_result is not None:
                        on_result(items[index], done[index])
        except BaseException:
            _stop_workers(pool)
            raise
        pool.shutdown(wait=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unheld)
    return [done[index] for index in range(len(items))]


BESIDE_NICENESS = 19  # background_map's workers: they take a core only when nothing else of the run wants it


@contextlib.contextmanager
def background_map(function: Callable[[Item], Result], items: Iterable[Item], *, jobs: int):
    """``process_map``'s work started now, beside what the block does meanwhile, in ``jobs`` worker processes (at
    least one) that run at the lowest priority (``BESIDE_NICENESS``): they use what the block leaves idle of the
    cores. Yields ``collect()``, which waits for the jobs and returns their results in the order of the items (a
    job's exception is raised there; call it within the block). Leaving the block by an exception cancels what is
    queued and ends the workers before the exception goes on; leaving it without collecting waits for the jobs.
    """
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    items = list(items)
    jobs = max(1, min(jobs, len(items)))
    unheld = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)  # the pool's thread and workers start with them
    try:
        pool = ProcessPoolExecutor(jobs, mp_context=get_context(start_method()), initializer=_start_worker,
                                   initargs=(threads_per_run(jobs), os.getpid(), BESIDE_NICENESS))  # fmt: skip
        futures = [pool.submit(function, item) for item in items]
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unheld)

    def collect() -> list[Result]:  # within the block: a job's exception leaves it, and the workers end
        return [future.result() for future in futures]

    try:
        yield collect
    except BaseException:
        _stop_workers(pool)
        raise
    pool.shutdown(wait=True)


HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM}
SIGNAL_POLL_SECONDS = 0.2  # how soon a Ctrl-C or SIGTERM reaches the parent's loop while workers run


def _start_methods() -> list[str]:
    from multiprocessing import get_all_start_methods

    return get_all_start_methods()


def start_method(platform: str | None = None) -> str:
    """How workers start: forked where that is safe (Linux: they inherit the imported modules), spawned on macOS,
    where a forked child of a process that touched Core ML or any Apple framework is not safe (and Python's
    own default there is spawn since 3.8)."""
    if (platform or sys.platform) == "darwin" or "fork" not in _start_methods():
        return "spawn"
    return "fork"


def each_when_free(items: list, attempt) -> dict:
    """``{item: attempt(item, wait)}`` for every item, taking first the ones no other process is working on:
    ``attempt(item, wait=False)`` returns None when another process holds the item's lock, and that item is
    tried again after the others; only when every remaining item is held elsewhere does it wait for the first
    (``wait=True``). Two studies asking the same items at once then share the work instead of queueing behind
    each other (and the second reuses what the first finished)."""
    done: dict = {}
    while len(done) < len(items):
        progressed = False
        for item in items:
            if item not in done and (result := attempt(item, wait=False)) is not None:
                done[item], progressed = result, True
        if not progressed:
            first = next(item for item in items if item not in done)
            done[first] = attempt(first, wait=True)
    return {item: done[item] for item in items}
