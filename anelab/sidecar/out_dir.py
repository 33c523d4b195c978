"""An export's output directory: one writer per package, the packages staged and moved in as a set.

``exporting(out, layers)`` checks ``--out`` before any work (a directory, or a path one can be made at),
takes a lock on each ``layer_<L>.mlpackage`` it will write (``.layer_<L>.lock``, an ``flock`` the kernel
drops when its holder dies, so a killed export leaves no lock that blocks the next one) and refuses a
layer another live export is writing. Packages are built in a staging folder inside ``out`` (coremltools'
temporary files too: ``$TMPDIR`` is pointed into it), and ``commit`` moves the finished set into place
with SIGINT / SIGTERM held off. Any failure or interrupt before that removes the staging folder: ``out``
then holds what it held before, and a directory the export created is removed again. A staging folder
left by a killed export (its own lock free) is removed by the next export into the same directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.core.output_paths import make_output_dir, write_failure
from anelab.core.parallel import forget_kept_fd, keep_from_workers
from anelab.core.termination import raise_if_terminated

STAGING_PREFIX = ".anelab-staging-"  # a staging folder inside --out (never matched as a package)
MAKING_PREFIX = ".anelab-making-"  # a staging folder before its owner holds its lock (then renamed to STAGING_PREFIX)
OWNER_LOCK = "owner.lock"  # inside a staging folder: held by the export that owns it


def lock_name(layer: int) -> str:
    return f".layer_{layer}.lock"


def write_error(e: OSError, out: Path) -> AnelabInputError:
    """One line for an OSError met while writing into ``out`` (no space, read-only, permission, ...)."""
    return write_failure(e, out, "--out", "the export")


def prepare_out(out: str | os.PathLike) -> tuple[Path, bool]:
    """(``out`` as a directory, whether this call created it); refuses a file, a device, a path under a
    file, a read-only or full disk and a directory that cannot be created (one line each), before any work."""
    return make_output_dir(out, "--out", "the export")


# what coremltools' C++ says when a write fails: its weight writer, and std::filesystem's copy of a saved package
# ("filesystem error: cannot copy: No space left on device [src] [dest]")
COREMLTOOLS_WRITE_FAILURES = ("FileWriter", "cannot copy", "No space left on device", "File too large")


def is_coremltools_write_failure(e: RuntimeError) -> bool:
    """Whether coremltools' RuntimeError ``e`` is a write that failed (a full disk, a file-size limit)."""
    return any(text in str(e) for text in COREMLTOOLS_WRITE_FAILURES)


@dataclass
class _LayerLock:
    path: Path
    fd: int


def _take_lock(path: Path, what: str) -> _LayerLock:
    """An exclusive ``flock`` on ``path`` (created), or a one-line refusal when a live process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise AnelabInputError(
                f"another anelab export (pid {holder}) is writing {what}; wait for it to finish or choose another --out"
            ) from None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:  # still the file at that name (not one just unlinked)
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
                keep_from_workers(fd)
                return _LayerLock(path, fd)
        os.close(fd)


def _release(lock: _LayerLock) -> None:
    with contextlib.suppress(OSError):
        os.unlink(lock.path)
    forget_kept_fd(lock.fd)
    os.close(lock.fd)


def remove_abandoned_staging(out: Path) -> None:
    """Staging folders whose owner is gone (its ``owner.lock`` free): left by an export killed with SIGKILL. A
    folder still being made (``MAKING_PREFIX``) is removed only when the process in its name is gone."""
    for folder in out.glob(f"{MAKING_PREFIX}*"):
        if not _alive(folder.name.removeprefix(MAKING_PREFIX).split("-")[0]):
            shutil.rmtree(folder, ignore_errors=True)
    for folder in out.glob(f"{STAGING_PREFIX}*"):
        owner = folder / OWNER_LOCK
        try:
            fd = os.open(owner, os.O_RDONLY)
        except OSError:  # no owner lock yet: being created right now, unless the pid in its name is gone
            if not _alive(folder.name.removeprefix(STAGING_PREFIX).split("-")[0]):
                shutil.rmtree(folder, ignore_errors=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live export owns it
        finally:
            os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: str) -> bool:
    """Whether the process ``pid`` (a decimal string) exists; a malformed one counts as gone."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Staging:
    """Where one export builds its packages (``folder``) and its temporary files (``tmp``)."""

    out: Path
    folder: Path
    tmp: Path
    committed: list[Path] = field(default_factory=list)

    def commit(self, layers: list[int], suffix: str = ".mlpackage") -> list[Path]:
        """Move every staged ``layer_<L><suffix>`` (the back-end's: ``.mlpackage``, ``.aimodel``) into ``out`` (an
        older one is replaced), with SIGINT and SIGTERM held until all are in place, so an interrupt cannot leave
        half the set."""
        staged = [self.folder / f"layer_{layer}{suffix}" for layer in layers]
        missing = [p.name for p in staged if not p.exists()]
        if missing:
            raise AnelabInputError(f"the export did not produce {missing[0]}; nothing was written to {self.out}")
        raise_if_terminated()  # a SIGTERM that library code swallowed must not let the set land
        held = {signal.SIGINT, signal.SIGTERM}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            for src in staged:
                dest = self.out / src.name
                if dest.exists():
                    old = self.folder / f"{src.name}.replaced"
                    os.replace(dest, old)
                os.replace(src, dest)
                self.committed.append(dest)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        return self.committed


@contextlib.contextmanager
def exporting(out: str | os.PathLike, layers: list[int]) -> Iterator[Staging]:
    """Check ``out``, lock its ``layers``, and yield a ``Staging`` (``$TMPDIR`` inside it) for the export; on
    any exit the staging folder and the locks are removed, and an ``out`` this call created and left empty
    is removed too (see the module docstring)."""
    out, created = prepare_out(out)
    locks: list[_LayerLock] = []
    staging = making = None
    saved_tmp = tempfile.tempdir
    try:
        for layer in sorted(set(layers)):
            locks.append(_take_lock(out / lock_name(layer), f"layer_{layer}.mlpackage in {out}"))
        remove_abandoned_staging(out)
        # made under another name and renamed once its owner lock is held: another export into ``out`` (decide's
        # workers export a layer each) never sees a staging folder whose lock is free because it is not taken yet
        making = Path(tempfile.mkdtemp(dir=out, prefix=f"{MAKING_PREFIX}{os.getpid()}-"))
        owner = _take_lock(making / OWNER_LOCK, str(making))
        locks.append(owner)
        folder = out / (STAGING_PREFIX + making.name.removeprefix(MAKING_PREFIX))
        os.replace(making, folder)
        owner.path = folder / OWNER_LOCK
        staging = Staging(out, folder, folder / "tmp")
        staging.tmp.mkdir()
        tempfile.tempdir = str(staging.tmp)  # coremltools' temporary packages and weight folders land here
        yield staging
    except OSError as e:
        raise write_error(e, out) from None
    except RuntimeError as e:  # coremltools reports a failed write (ENOSPC, EFBIG) only as text: its weight writer
        if not is_coremltools_write_failure(e):  # ("FileWriter") or the package's std::filesystem copy ("cannot copy")
            raise
        raise AnelabInputError(
            f"cannot write the export to {out}: coremltools could not write the package (no space left, or a file "
            "size limit); free space or choose another --out"
        ) from None
    finally:
        tempfile.tempdir = saved_tmp
        if staging is not None:
            shutil.rmtree(staging.folder, ignore_errors=True)
        if making is not None and making.exists():  # failed before it became the staging folder
            shutil.rmtree(making, ignore_errors=True)
        for lock in reversed(locks):
            _release(lock)
        if created and not any(out.iterdir()):
            with contextlib.suppress(OSError):
                out.rmdir()


def replace_directory(src: Path, dest: Path) -> None:
    """Move a finished package (or asset) folder into place; an existing one is swapped out, then removed."""
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
        os.replace(src, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dest)
