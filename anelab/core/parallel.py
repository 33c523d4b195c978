"""Independent jobs on the machine's cores: how many may run at once, and a process pool that runs them.

Exporting and verifying one layer's sidecar are independent of every other layer's, and mostly
single-threaded Python (coremltools' pass pipeline, the MIL interpreter's op loop): ``process_map``
runs them in worker processes, each with ``threads_per_run`` BLAS threads so that workers x threads
never exceed the cores. Results come back in the order of the items, whatever order they finish in;
an exception in a worker is raised in the caller (an ``AnelabInputError`` keeps its one line).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from typing import TypeVar

from anelab.core.errors import AnelabInputError

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


def default_jobs(items: int, cores: int | None = None) -> int:
    """Workers for ``items`` independent per-layer jobs: at most the cores, the items and ``DEFAULT_MAX_JOBS``."""
    cores = available_cores() if cores is None else cores
    return max(1, min(cores, items, DEFAULT_MAX_JOBS))


def _limit_threads(threads: int) -> None:
    """In a worker: cap BLAS (and the interpreter's tile threads, which read the same variables) at ``threads``."""
    from threadpoolctl import threadpool_limits

    for name in THREAD_CAP_VARIABLES:
        os.environ[name] = str(threads)
    threadpool_limits(limits=threads, user_api="blas")


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
    import time; on macOS they are spawned.
    """
    items = list(items)
    threads = threads_per_run(jobs)
    if jobs == 1 or len(items) <= 1:
        results = []
        for item in items:
            results.append(function(item))
            if on_result is not None:
                on_result(item, results[-1])
        return results
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from multiprocessing import get_context

    done: dict[int, Result] = {}
    context = get_context(start_method())
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_limit_threads, initargs=(threads,)) as pool:
        futures = {pool.submit(function, item): index for index, item in enumerate(items)}
        for future in as_completed(futures):
            index = futures[future]
            done[index] = future.result()  # a worker's exception is raised here, in the caller
            if on_result is not None:
                on_result(items[index], done[index])
    return [done[index] for index in range(len(items))]


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
