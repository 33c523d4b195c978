"""Faults during an export and hostile sets: interrupts leave no process and no package, a failed or partial
export is never a set that verifies, one writer per package, read-only commands write nothing.

Signals are sent to real ``anelab export --jobs 2`` processes (``python -m anelab``) while their workers run.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.default import make_dense_checkpoint
from anelab.cli import main
from anelab.core import parallel
from anelab.core.errors import AnelabInputError
from anelab.sidecar.out_dir import STAGING_PREFIX, lock_name

CHUNK = 16
SLOW_HISTORIES = ",".join(str(CHUNK * i) for i in range(24))  # 24 functions a layer: long enough to interrupt
START_TIMEOUT_S = 120  # a worker starts converting within this (the parent imports coremltools first)
EXIT_TIMEOUT_S = 30  # an interrupted export must be gone within this (workers stopped, staging removed)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return make_dense_checkpoint(tmp_path_factory.mktemp("faults") / "dense")


def _export(ckpt: Path, out: Path, *extra: str, histories: str = f"0,{CHUNK}") -> list[str]:
    return ["export", str(ckpt), "--chunk", str(CHUNK), "--histories", histories, "--out", str(out), *extra]


def _spawn(argv: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "ANELAB_HEADLESS": "1"}
    return subprocess.Popen([sys.executable, "-m", "anelab", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True, **kwargs)  # fmt: skip


def _wait_for_workers(proc: subprocess.Popen, out: Path, workers: int) -> list[psutil.Process]:
    """The export's worker processes once ``workers`` of them are converting a layer (their work folders exist)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        started = [p for s in out.glob(f"{STAGING_PREFIX}*") for p in s.glob(".layer_*")]
        children = psutil.Process(proc.pid).children(recursive=True)
        if len(started) >= max(1, workers) and len(children) >= workers:
            return children
        time.sleep(0.2)
    raise AssertionError(f"no {workers} workers started within {START_TIMEOUT_S} s")


def _assert_nothing_left(out: Path, processes: list[psutil.Process]) -> None:
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes):
        time.sleep(0.2)
    alive = [p.pid for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"worker processes outlived the export: {alive}"
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


@pytest.mark.parametrize(
    "how, code, jobs",
    [
        ("SIGTERM to the parent", 143, 2),
        ("SIGINT to the parent", 130, 2),
        ("Ctrl-C to the process group", 130, 2),
        ("SIGTERM to the parent", 143, 1),  # one process: its own work folder (.layer_0.*) must go too
    ],
)
def test_an_interrupted_export_leaves_no_process_and_no_package(dense, tmp_path, how, code, jobs):
    out = tmp_path / "out"
    proc = _spawn(_export(dense, out, "--jobs", str(jobs), histories=SLOW_HISTORIES))
    workers = _wait_for_workers(proc, out, jobs if jobs > 1 else 0)
    started = time.monotonic()
    if how == "Ctrl-C to the process group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=EXIT_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # a failed test leaves no export running
    assert proc.returncode == code, err
    assert time.monotonic() - started < EXIT_TIMEOUT_S / 2  # not after every queued layer has finished
    assert "Traceback" not in err
    _assert_nothing_left(out, workers)


def test_workers_die_with_a_killed_parent_and_the_next_export_clears_what_it_left(dense, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = _spawn(_export(dense, out, "--jobs", "2", histories=SLOW_HISTORIES))
    workers = _wait_for_workers(proc, out, 2)
    proc.kill()  # SIGKILL: no handler runs, so the staging folder stays behind
    proc.wait(timeout=EXIT_TIMEOUT_S)
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers):
        time.sleep(0.2)
    assert not [p.pid for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert list(out.glob(f"{STAGING_PREFIX}*")), "SIGKILL leaves its staging folder (the control of this test)"
    assert main(_export(dense, out, "--jobs", "1")) == 0  # the dead export's locks do not block it ...
    assert sorted(p.name for p in out.iterdir()) == [f"layer_{i}.mlpackage" for i in range(4)]  # ... and it clears up


def test_a_failing_layer_cancels_the_rest_and_leaves_no_new_package(dense, tmp_path, capsys):
    """Layer 2's k_proj is I8 (a dtype anelab does not read): refused before any layer is exported."""
    ckpt = tmp_path / "ck"
    shutil.copytree(dense, ckpt)
    _set_dtype(ckpt / "model.safetensors", "model.layers.2.self_attn.k_proj.weight", "U8")
    out = tmp_path / "out"
    assert main(_export(ckpt, out, "--jobs", "2")) == 2
    assert "layers.2.self_attn.k_proj.weight" in capsys.readouterr().err
    assert not out.exists()


def _set_dtype(path: Path, name: str, dtype: str) -> None:
    """Rewrite one tensor's dtype (and its shape, so its bytes still match) in a safetensors header."""
    import struct

    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + n])
    header[name]["dtype"] = dtype
    header[name]["shape"] = [header[name]["data_offsets"][1] - header[name]["data_offsets"][0]]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + blob[8 + n :])


def _slow_or_fail(job: tuple[int, str]) -> int:
    item, pids = job
    Path(pids, str(os.getpid())).touch()
    if item == 1:
        time.sleep(1)  # the other worker is running item 0 by now
        raise AnelabInputError("item 1 is bad")
    time.sleep(60)
    return item


def test_a_workers_failure_cancels_what_is_queued_and_ends_the_running_ones(tmp_path):
    started = time.monotonic()
    with pytest.raises(AnelabInputError, match="item 1 is bad"):
        parallel.process_map(_slow_or_fail, [(i, str(tmp_path)) for i in range(8)], jobs=2)
    assert time.monotonic() - started < 30  # not 60 s per queued item
    workers = [int(p.name) for p in tmp_path.iterdir()]
    assert len(workers) == 2  # items 2..7 never started: cancelled
    assert not [
        pid for pid in workers if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]


def test_a_second_writer_of_a_package_is_refused_and_a_dead_writers_lock_is_not(dense, tmp_path, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom anelab.sidecar.out_dir import exporting\n"
         f"with exporting({str(out)!r}, [1]):\n    print('held', flush=True)\n    time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(_export(dense, out, "--jobs", "1")) == 2
        err = capsys.readouterr().err
        assert f"(pid {holder.pid}) is writing layer_1.mlpackage" in err and len(err.strip().splitlines()) == 1
        assert not list(out.glob("layer_*.mlpackage"))
    finally:
        holder.kill()
        holder.wait()
    assert (out / lock_name(1)).exists()  # SIGKILL left the file; the kernel released its lock
    assert main(_export(dense, out, "--jobs", "1", "--layers", "1")) == 0
    assert [p.name for p in out.iterdir()] == ["layer_1.mlpackage"]


def test_coremltools_temporaries_stay_in_the_staging_folder_and_are_removed_as_each_is_saved(
    dense, tmp_path, monkeypatch
):
    import tempfile

    from anelab.sidecar import export

    real, seen = export.save_model, []

    def counting(model, dest):
        tmp = Path(tempfile.gettempdir())
        seen.append((tmp.parent.name.startswith(STAGING_PREFIX), len(list(tmp.glob("*.mlpackage")))))
        real(model, dest)

    monkeypatch.setattr(export, "save_model", counting)
    export.export_sidecars(
        load_checkpoint(dense), tmp_path / "out", CHUNK, [0, CHUNK, 2 * CHUNK], layers=[0, 1], jobs=1
    )
    assert len(seen) == 2 * (3 + 1)  # three functions and the merge per layer
    assert all(in_staging for in_staging, _ in seen)
    assert max(n for _, n in seen) == 1  # the one being saved; without save_model's removal: 1, 2, 3, ...
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["layer_0.mlpackage", "layer_1.mlpackage"]


def _no_big_files():
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))  # weight.bin of one layer is ~100 KB
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG


def test_a_full_disk_is_one_line_and_leaves_nothing(dense, tmp_path):
    out = tmp_path / "out"
    proc = _spawn(_export(dense, out, "--jobs", "1"), preexec_fn=_no_big_files)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert (
        err.strip().splitlines()[-1].startswith("anelab: error: cannot write the export to") and "Traceback" not in err
    )
    assert not out.exists()


def test_a_read_only_out_is_one_line(dense, tmp_path, capsys, monkeypatch):
    """A directory this process may not write into. As root (CI) permission bits do not stop a write, so the
    kernel's refusal is what ``mkdir`` raises there; elsewhere the directory is made read-only for real."""
    out = tmp_path / "read-only"
    out.mkdir()
    out.chmod(0o555)
    if os.geteuid() == 0:
        real_mkdir = Path.mkdir

        def refused(self, *args, **kwargs):
            if self.is_relative_to(out):
                raise PermissionError(13, "Permission denied", str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", refused)
    try:
        assert main(_export(dense, out / "sub", "--jobs", "1")) == 2
    finally:
        out.chmod(0o755)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write the export to" in err[0] and "Permission denied" in err[0]
    assert not list(out.iterdir())


# ---- an export is a set: verify DIR checks the set against the checkpoint ----------------------------------


@pytest.fixture(scope="module")
def full_export(dense, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("set") / "export"
    assert main(_export(dense, out, "--jobs", "1")) == 0
    return out


def _copy_set(full_export: Path, dest: Path, layers) -> Path:
    dest.mkdir()
    for layer in layers:
        shutil.copytree(full_export / f"layer_{layer}.mlpackage", dest / f"layer_{layer}.mlpackage")
    return dest


def test_verify_dir_fails_a_partial_export_and_passes_the_whole_one(full_export, tmp_path, capsys):
    assert main(["verify", str(full_export)]) == 0  # the negative control: the complete set passes
    capsys.readouterr()
    partial = _copy_set(full_export, tmp_path / "partial", [0, 1, 3])
    assert main(["verify", str(partial)]) == 1
    out = capsys.readouterr().out
    assert "not one export: layer_2 is missing" in out and "FAILED: the set" in out
    assert "PASSED" not in out
    assert main(["verify", str(partial), "--layers", "0,1,3"]) == 0  # the set asked for with export --layers
    assert main(["verify", str(partial), "--layers", "0,1,2"]) == 1  # control: layer 2 asked for, not there
    assert "layer_2 is missing (1 of the requested 3" in capsys.readouterr().out
    assert main(["verify", str(partial), "--layers", "0,7"]) == 2  # layer 7 is no attention layer: refused
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--layers 7: not an attention layer" in err[0], err
    assert main(["verify", str(partial / "layer_0.mlpackage"), "--layers", "0"]) == 2  # --layers on one package


def test_verify_dir_fails_two_designs_and_two_checkpoints(dense, full_export, tmp_path, capsys):
    mixed = _copy_set(full_export, tmp_path / "mixed", [0, 1, 2])
    assert main(["export", str(dense), "--chunk", str(CHUNK), "--histories", f"0,{CHUNK}", "--graph", "tiled",
                 "--layers", "3", "--out", str(tmp_path / "tiled")]) == 0  # fmt: skip
    shutil.copytree(tmp_path / "tiled" / "layer_3.mlpackage", mixed / "layer_3.mlpackage")
    assert main(["verify", str(mixed)]) == 1
    assert "the packages are 2 designs" in capsys.readouterr().out
    other = tmp_path / "copy-of-dense"
    shutil.copytree(dense, other)
    assert main(_export(other, tmp_path / "other", "--jobs", "1", "--layers", "3")) == 0
    two = _copy_set(full_export, tmp_path / "two", [0, 1, 2])
    shutil.copytree(tmp_path / "other" / "layer_3.mlpackage", two / "layer_3.mlpackage")
    capsys.readouterr()
    assert main(["verify", str(two)]) == 1
    assert "the packages come from 2 checkpoints" in capsys.readouterr().out
    assert main(["verify", str(two), "--checkpoint", str(dense)]) == 0  # one checkpoint by content: the same tensors


# ---- read-only commands write nothing -----------------------------------------------------------------------


def _stamps(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*"))}


def test_inspect_and_verify_never_rewrite_a_package(full_export, dense, tmp_path, capsys):
    pkg = tmp_path / "layer_0.mlpackage"
    shutil.copytree(full_export / "layer_0.mlpackage", pkg)
    before = _stamps(pkg)
    time.sleep(0.01)
    assert main(["inspect", str(pkg)]) == 0
    assert main(["verify", str(pkg), "--checkpoint", str(dense)]) == 0
    assert _stamps(pkg) == before
    from anelab.sidecar.coremltools_import import coremltools_modules

    coremltools_modules()[0].utils.load_spec(str(pkg))  # the control: coremltools' own reader rewrites Manifest.json
    assert _stamps(pkg)[str(pkg / "Manifest.json")] != before[str(pkg / "Manifest.json")]


# ---- records: one corrupt record does not hide the others --------------------------------------------------


def test_records_list_reports_a_corrupt_record_and_lists_the_rest(tmp_path, capsys):
    from anelab.core.paths import DATA_DIR

    for src in DATA_DIR.glob("*.json"):
        shutil.copy(src, tmp_path / src.name)
    assert main(["records", "list", "--dir", str(tmp_path)]) == 0
    listed = capsys.readouterr().out.strip().splitlines()
    (tmp_path / "broken.json").write_bytes(b'{"schema_version": 1, \xff')
    assert main(["records", "list", "--dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "broken.json" in err and "not UTF-8" in err and len(err.strip().splitlines()) == 1
    assert out.strip().splitlines()[:-1] == listed[:-1]  # every readable record still listed
    assert out.strip().splitlines()[-1] == f"{listed[-1]} (1 unreadable, skipped: see stderr)"
    assert main(["records", "compare", "--dir", str(tmp_path)]) == 2  # compare needs every value: still refused


# ---- confinement: the Hugging Face cache's own links still load ----------------------------------------------


def test_a_hugging_face_cache_snapshot_loads_and_a_link_out_of_it_does_not(dense, tmp_path):
    """The cache keeps files in ``<repo>/blobs/`` and links them from ``<repo>/snapshots/<revision>/``: that is
    the one place outside the checkpoint directory a checkpoint file may resolve to (the control of the
    confinement rule); a link anywhere else is refused."""
    from anelab.checkpoints.checkpoint import load_checkpoint

    repo = tmp_path / "models--org--dense"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(dense / name, blobs / f"blob-{name}")
        (snapshot / name).symlink_to(Path("../../blobs") / f"blob-{name}")
    assert load_checkpoint(snapshot).geometry.num_layers == 4
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(blobs / "blob-model.safetensors", elsewhere / "model.safetensors")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(elsewhere / "model.safetensors")
    with pytest.raises(AnelabInputError, match="outside"):
        load_checkpoint(snapshot)


def test_an_export_beside_another_never_takes_its_staging_folder_for_an_abandoned_one(tmp_path, monkeypatch):
    """Two exports into one directory (decide's workers export a layer each): one clears abandoned staging
    folders at the moment the other's owner lock file exists but is not yet locked. The other's folder is not
    visible as a staging folder until its lock is held, so it survives and its export lands. Control: a staging
    folder whose owner is gone is cleared."""
    from anelab.sidecar import out_dir

    out = tmp_path / "out"
    out.mkdir()
    real = out_dir._take_lock

    def racing(path, what):
        if path.name == out_dir.OWNER_LOCK:
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))  # created, not yet locked
            out_dir.remove_abandoned_staging(out)  # the other export, clearing up at that moment
        return real(path, what)

    monkeypatch.setattr(out_dir, "_take_lock", racing)
    with out_dir.exporting(out, [0]) as staging:
        assert staging.folder.name.startswith(STAGING_PREFIX) and staging.folder.is_dir()
        (staging.folder / "layer_0.mlpackage").mkdir()
        staging.commit([0])
    assert (out / "layer_0.mlpackage").is_dir()
    gone = out / f"{STAGING_PREFIX}999999999-x"  # control: an owner that does not exist
    gone.mkdir()
    (gone / out_dir.OWNER_LOCK).write_text("999999999")
    out_dir.remove_abandoned_staging(out)
    assert not gone.exists()


# ---- issue 44: real read-only and full disks (a tmpfs in a user and mount namespace), SIGTERM in decide ----------
# `unshare -Urm` (util-linux) gives this test a mount namespace of its own, where it mounts small tmpfs file systems:
# a read-only one, one without room, one that fills while an export or decide writes into it.

UNSHARE = shutil.which("unshare")
FILL = 'dd if=/dev/zero of="$M/fill" bs=64k 2>/dev/null || true'  # takes what is left of the tmpfs


def _in_namespace(script: str, **env) -> subprocess.CompletedProcess:
    # util-linux's unshare is on every Debian machine (a mount namespace for a real read-only / full file system)
    assert UNSHARE is not None, "needs util-linux's unshare: apt-get install util-linux"
    env = {**os.environ, "ANELAB_HEADLESS": "1", "PY": sys.executable, **{k: str(v) for k, v in env.items()}}
    return subprocess.run([UNSHARE, "-Urm", "sh", "-c", script], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip


WRITERS = {  # command -> argv with {out} the output path under the mount
    "export": lambda dense, pkg: [*_export(dense, Path("{out}"), "--jobs", "1")],
    "decide": lambda dense, pkg: ["decide", str(dense), "--prompt-tokens", "64", "--chunk", "16", "--out", "{out}"],
    "evaluate": lambda dense, pkg: [
        "evaluate",
        str(pkg),
        "--function",
        "h0",
        "--inputs",
        "x.npz",
        "--out",
        "{out}/y.npz",
    ],  # fmt: skip
    "probe --out": lambda dense, pkg: ["probe", "--chunk", "16", "--repeats", "1", "--out", "{out}"],
    "probe --records": lambda dense, pkg: ["probe", "--chunk", "16", "--repeats", "1", "--records", "{out}"],
    "docs": lambda dense, pkg: ["docs", "--out", "{out}"],
    "ab": lambda dense, pkg: [
        "ab",
        str(dense),
        "--sidecars",
        str(pkg.parent),
        "--prompt-tokens",
        "16",
        "--out",
        "{out}",
    ],  # fmt: skip
}

_DRIVER = """
import contextlib, io, json, sys
from anelab.cli import main
for line in sys.stdin:
    name, argv = json.loads(line)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except BaseException as e:
            code = f"{type(e).__name__}: {e}"
    print(json.dumps([name, code, err.getvalue()]), flush=True)
"""


def test_every_command_that_writes_refuses_a_read_only_or_full_disk_before_working(full_export, dense, tmp_path):
    """Each command's output under a read-only tmpfs and under a 64 KiB tmpfs: exit 2, one line naming the
    cause, before any work (nothing written to the full one: its file list is printed after the runs)."""
    read_only, full = tmp_path / "ro", tmp_path / "full"
    read_only.mkdir(), full.mkdir()
    runs = [[f"{name} {where}", [a.replace("{out}", str(mount / "out")) for a in argv(dense, full_export / "layer_0.mlpackage")]]
            for name, argv in WRITERS.items() for where, mount in (("read-only", read_only), ("full", full))]  # fmt: skip
    script = (f'mount -t tmpfs -o ro,size=1m tmpfs "{read_only}" && mount -t tmpfs -o size=64k tmpfs "{full}" && '
              f'"$PY" -c "$DRIVER" <<"EOF"\n' + "\n".join(json.dumps(r) for r in runs) + f'\nEOF\nls -A "{full}"')  # fmt: skip
    done = _in_namespace(script, DRIVER=_DRIVER)
    lines = done.stdout.strip().splitlines()
    results = [json.loads(line) for line in lines[: len(runs)]]
    assert len(results) == len(runs), done.stderr[-2000:]
    for name, code, err in results:
        assert code == 2 and len(err.strip().splitlines()) == 1, (name, code, err[-600:])
        assert ("Read-only file system" if name.endswith("read-only") else "free, less than") in err, (name, err)
    assert lines[len(runs) :] == [], lines  # nothing written to the full disk


def test_a_disk_that_fills_during_an_export_or_a_decide_is_one_line_and_leaves_no_folder(dense, tmp_path):
    """A 20 MiB tmpfs passes the check before work; it is filled once the export's staging folder (decide's, in
    its sidecar folder) appears. Then: exit 2, one line (coremltools' 'cannot copy' or weight writer, or Python's
    ENOSPC, whichever write meets the full disk first), and no package, staging folder or empty folder left."""
    mount = tmp_path / "disk"
    mount.mkdir()
    for argv, appears in (
        (_export(dense, mount / "out", "--jobs", "1", histories=SLOW_HISTORIES), "out/.anelab-staging-*"),
        (["decide", str(dense), "--prompt-tokens", "64", "--chunk", "16", "--out", str(mount / "out")],
         "out/sidecars/*/.anelab-staging-*"),
    ):  # fmt: skip
        script = (f'M="{mount}"; mount -t tmpfs -o size=20m tmpfs "$M" || exit 99\n'
                  f'"$PY" -m anelab {" ".join(argv)} 2>"$M/../err" & pid=$!\n'
                  f'while [ -z "$(ls -d $M/{appears} 2>/dev/null)" ] && kill -0 $pid 2>/dev/null; do sleep 0.1; done\n'
                  f'{FILL}\nwait $pid; echo "exit $?"; cd "$M" && find . -mindepth 1 \\( -type d -empty -o -name ".anelab-*" '
                  f'-o -name "*.mlpackage" \\) -print | sort')  # fmt: skip
        done = _in_namespace(script)
        err = (tmp_path / "err").read_text()
        lines = done.stdout.strip().splitlines()
        assert lines[:1] == ["exit 2"], (argv[0], done.stdout, done.stderr[-500:], err[-2000:])
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("anelab: error: cannot write"), err
        assert lines[1:] == [], lines  # no empty folder, no staging folder, no package left behind


def _empty_folders(root: Path) -> list[str]:
    return sorted(str(d) for d in [root, *root.rglob("*")] if d.is_dir() and not any(d.iterdir()))


def test_decide_terminated_during_its_export_leaves_no_empty_folder(dense, tmp_path):
    out = tmp_path / "out"
    proc = _spawn(["decide", str(dense), "--prompt-tokens", "64", "--chunk", "16", "--out", str(out)])
    deadline = time.monotonic() + START_TIMEOUT_S
    while not list(out.glob(f"sidecars/*/{STAGING_PREFIX}*")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=EXIT_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert not out.exists() or not _empty_folders(out), _empty_folders(out)


def test_a_one_tib_sparse_tensor_under_ulimit_v_is_one_line(dense, tmp_path):
    """A 1 TiB tensor the exporter never reads, in a sparse file: under an address-space limit (ulimit -v) the
    file cannot be memory-mapped, which is said in one line (it was a MemoryError traceback). Control: without the
    limit the same checkpoint exports."""
    import struct

    ck = shutil.copytree(dense, tmp_path / "big")
    path = ck / "model.safetensors"
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header, body = json.loads(blob[8 : 8 + n]), blob[8 + n :]
    header["model.unused.weight"] = {
        "dtype": "F16",
        "shape": [2**19, 2**20],
        "data_offsets": [len(body), len(body) + 2**40],
    }
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + body)
        f.truncate(8 + len(text) + len(body) + 2**40)

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))

    proc = _spawn(_export(ck, tmp_path / "out", "--jobs", "1"), preexec_fn=limited)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in err, err[-2000:]
    assert len(err.strip().splitlines()) == 1 and "1.0 TiB cannot be memory-mapped" in err and "RLIMIT_AS" in err
    assert not (tmp_path / "out").exists()
    assert main(_export(ck, tmp_path / "control", "--jobs", "1", "--layers", "0")) == 0  # no limit: it maps and exports
