"""Per-layer work in worker processes (``anelab.core.parallel``): same results as one at a time, in order, with
errors and refusals as the caller would see them in one process."""

from __future__ import annotations

import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.cli import main
from anelab.core import parallel
from anelab.core.errors import AnelabInputError
from anelab.core.files import entry_lock
from anelab.sidecar.checks.verify_export import verify_export
from anelab.sidecar.coremltools_import import coremltools_modules
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import META, WEIGHTS_RELATIVE

CHUNK = 4


def _square_or_refuse(n: int) -> int:
    if n < 0:
        raise AnelabInputError(f"item {n} is negative; pass a count")
    return n * n


def _pid(_: int) -> int:
    import os

    return os.getpid()


def test_results_come_back_in_item_order_from_several_processes():
    seen = []
    assert parallel.process_map(_square_or_refuse, [5, 1, 4, 2], jobs=2, on_result=lambda i, r: seen.append(i)) == [
        25,
        1,
        16,
        4,
    ]
    assert sorted(seen) == [1, 2, 4, 5]
    import os

    assert os.getpid() not in parallel.process_map(_pid, [0, 1, 2, 3], jobs=2)  # control: really in workers
    assert parallel.process_map(_pid, [0, 1], jobs=1) == [os.getpid()] * 2


def _frozen(_: int) -> int:
    import gc

    return gc.get_freeze_count()


def test_a_worker_freezes_what_it_inherited_so_its_collections_walk_only_what_it_makes():
    """A worker starts by freezing the heap it inherited (``gc.freeze``): a full collection there (coremltools'
    ``convert`` ends with one) skips the parent's objects. Control: in this process nothing is frozen."""
    import gc

    assert gc.get_freeze_count() == 0
    inherited = len(gc.get_objects())
    assert all(count >= inherited // 2 for count in parallel.process_map(_frozen, [0, 1], jobs=2))
    assert parallel.process_map(_frozen, [0, 1], jobs=1) == [0, 0]


def _niceness(n: int) -> tuple[int, int]:
    import os

    return n * n, os.nice(0)


def test_background_map_runs_beside_the_block_at_the_lowest_priority_and_stops_with_an_error():
    """``background_map``: the jobs run in workers while the block goes on (it is not waited for), at niceness
    ``BESIDE_NICENESS``, results in item order; a job's error is raised by ``collect``, and an error in the block
    ends the workers before it propagates."""
    import os
    import time

    start = time.perf_counter()
    with parallel.background_map(_niceness, [3, 1, 2], jobs=2) as collect:
        entered = time.perf_counter() - start
        results = collect()
    assert [r for r, _ in results] == [9, 1, 4] and entered < 5
    assert {nice for _, nice in results} == {min(19, os.nice(0) + parallel.BESIDE_NICENESS)}
    assert os.nice(0) != parallel.BESIDE_NICENESS  # control: this process runs at its own priority
    with pytest.raises(AnelabInputError, match="item -3 is negative"):
        with parallel.background_map(_square_or_refuse, [1, -3], jobs=2) as collect:
            collect()
    with pytest.raises(KeyError, match="the block failed"):
        with parallel.background_map(_square_or_refuse, [1, 2], jobs=2):
            raise KeyError("the block failed")


def test_a_workers_one_line_error_reaches_the_caller_unchanged():
    with pytest.raises(AnelabInputError, match="item -3 is negative; pass a count"):
        parallel.process_map(_square_or_refuse, [1, -3, 2], jobs=2)


def _fd_is_open(fd: int) -> bool:
    import os

    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_lock_the_parent_keeps_from_its_workers_is_closed_in_them(tmp_path):
    """An export's layer locks are flocks: a forked worker that kept the fd would hold the lock after the
    parent died. Workers close what ``keep_from_workers`` names; any other fd they inherit (the control) stays."""
    import os

    kept = os.open(tmp_path / "kept.lock", os.O_RDWR | os.O_CREAT)
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)
    parallel.keep_from_workers(kept)
    try:
        assert parallel.process_map(_fd_is_open, [kept, kept], jobs=2) == [False, False]
        assert parallel.process_map(_fd_is_open, [other, other], jobs=2) == [True, True]
        assert _fd_is_open(kept)  # the parent's own fd is untouched
    finally:
        parallel.forget_kept_fd(kept)
        os.close(kept)
        os.close(other)


def test_jobs_are_bounded_by_the_cores():
    assert parallel.threads_per_run(2, cores=2) == 1 and parallel.threads_per_run(1, cores=4) == 4
    for bad in (0, 3, True):
        with pytest.raises(AnelabInputError, match="--jobs"):
            parallel.threads_per_run(bad, cores=2)
    assert parallel.default_jobs(16, cores=8) == parallel.DEFAULT_MAX_JOBS
    assert parallel.default_jobs(1, cores=8) == 1 and parallel.default_jobs(16, cores=1) == 1


def test_a_run_given_a_share_of_the_cores_keeps_its_pools_within_it(monkeypatch):
    """``ANELAB_CORES`` (what ``reproduce`` gives each of its two notebooks) bounds the workers a run forks by itself;
    it never raises the machine's cores, and a value that is not a number of cores is refused in one line naming it.
    Control: unset, the cores."""
    monkeypatch.setattr(parallel, "available_cores", lambda: 2)
    monkeypatch.delenv(parallel.CORE_BUDGET_VARIABLE, raising=False)
    assert parallel.core_budget() == 2 and parallel.default_jobs(30) == 2  # control: the machine's cores
    for value, budget in (("1", 1), ("8", 2), (" 1 ", 1), ("", 2)):
        monkeypatch.setenv(parallel.CORE_BUDGET_VARIABLE, value)
        assert parallel.core_budget() == budget, value
        assert parallel.default_jobs(30) == budget, value
    for value in ("0", "many", "-1", "1.5"):
        monkeypatch.setenv(parallel.CORE_BUDGET_VARIABLE, value)
        with pytest.raises(AnelabInputError, match="ANELAB_CORES=.* is not a number of cores; set it to 1..2"):
            parallel.default_jobs(30)


def _package_bytes(pkg) -> tuple[bytes, bytes]:
    """(the spec without its export time, the weights) of a saved package."""
    ct, _, _ = coremltools_modules()
    spec = ct.utils.load_spec(str(pkg))
    del spec.description.metadata.userDefined[META["exported_at"]]
    return spec.SerializeToString(deterministic=True), (pkg / WEIGHTS_RELATIVE).read_bytes()


def test_exporting_layers_in_two_processes_writes_the_same_packages(tmp_path, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    one = export_sidecars(load_checkpoint(ckpt), tmp_path / "one", CHUNK, [0, CHUNK], jobs=1)
    two = export_sidecars(load_checkpoint(ckpt), tmp_path / "two", CHUNK, [0, CHUNK], jobs=2)
    assert [r.metadata.layer for r in two] == [r.metadata.layer for r in one] == [0, 1]
    for a, b in zip(one, two, strict=True):
        assert _package_bytes(a.package) == _package_bytes(b.package)
    # control: the comparison tells two layers apart
    assert _package_bytes(one[0].package) != _package_bytes(one[1].package)


class _Gate:
    verified_reason = "a test's gate"


def test_jobs_with_the_ane_gate_and_past_the_cores_are_refused(tmp_path, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    with pytest.raises(AnelabInputError, match="one at a time; drop --jobs"):
        export_sidecars(load_checkpoint(ckpt), tmp_path / "gated", CHUNK, [0], gate=_Gate(), jobs=2)
    cores = parallel.available_cores()
    assert (
        main(["export", str(ckpt), "--chunk", str(CHUNK), "--out", str(tmp_path / "x"), "--jobs", str(cores + 1)]) == 2
    )
    assert not (tmp_path / "x").exists()


def test_verifying_in_two_processes_gives_the_same_reports(tmp_path, tiny_checkpoint):
    export_sidecars(load_checkpoint(tiny_checkpoint("llama")), tmp_path / "sidecars", CHUNK, [0, CHUNK], jobs=1)
    one = verify_export(tmp_path / "sidecars", jobs=1)
    two = verify_export(tmp_path / "sidecars", jobs=2)
    assert one.passed and two.passed and len(two.layers) == 2
    for a, b in zip(one.layers, two.layers, strict=True):
        assert [(c.function, c.case, c.errors) for c in a.report.comparisons] == [
            (c.function, c.case, c.errors) for c in b.report.comparisons
        ]
    with pytest.raises(AnelabInputError, match="on the device one at a time"):
        verify_export(tmp_path / "sidecars", verify_one=lambda p, c: None, jobs=2)


def test_too_many_jobs_for_verify_is_one_line_before_any_work(tmp_path, tiny_checkpoint, capsys):
    export_sidecars(load_checkpoint(tiny_checkpoint("llama")), tmp_path / "sidecars", CHUNK, [0], jobs=1)
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "sidecars"), "--jobs", str(parallel.available_cores() + 1)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [err.strip()] and "--jobs" in err and "verify packages" not in err


def test_each_when_free_takes_the_free_items_first_and_waits_only_for_held_ones(tmp_path):
    """Another worker holds item a's lock: b and c are done meanwhile, then a once it is released; the results come
    back in the items' order. Control: with nothing held, every item is done at its first try, in order."""
    import threading

    tries = []

    def attempt(item, wait):
        with entry_lock(tmp_path / f"{item}.lock", wait=wait) as held:
            tries.append((item, held))
            return item.upper() if held else None

    assert parallel.each_when_free(["a", "b", "c"], attempt) == {"a": "A", "b": "B", "c": "C"}
    assert tries == [("a", True), ("b", True), ("c", True)]  # control: nothing held, nothing deferred
    tries.clear()
    holding, release = threading.Event(), threading.Event()

    def other_worker():  # another open file description: flock keeps it apart even within this process
        with entry_lock(tmp_path / "a.lock"):
            holding.set()
            release.wait(30)

    worker = threading.Thread(target=other_worker)
    worker.start()
    assert holding.wait(30)
    threading.Timer(0.3, release.set).start()
    result = parallel.each_when_free(["a", "b", "c"], attempt)
    worker.join()
    assert list(result.items()) == [("a", "A"), ("b", "B"), ("c", "C")]
    assert tries[:3] == [("a", False), ("b", True), ("c", True)] and tries[-1] == ("a", True)
