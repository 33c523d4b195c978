"""Where a command writes: one check of an output path before any work, and one line for a write that fails.

``require_output_dir`` is run by every command that writes (``export``, ``decide``, ``probe``, ``ab``, ``docs``,
``evaluate``'s file through ``require_output_file``) before it opens anything: the path must be a directory or
a path one can be made at — not a file, not under a file, not a device, not a symlink loop — on a file system
that is not read-only, that this process may write to and that has at least ``MIN_FREE_BYTES`` free. It creates
nothing (``make_output_dir`` creates the directory once the command is ready to write). ``write_failure`` and
``os_error_line`` turn an OSError met while writing (a disk that fills, a quota, a file-size limit, a read-only
file system, a symlink loop) into one line naming the path and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.core.files import file_kind
from anelab.core.limits import human_bytes

# Below this much free space a disk is full for any command here: a tiny model's package is ~100 KB, a record a
# few KB, but coremltools stages a copy of every package it saves, and a real model's layer is megabytes.
MIN_FREE_BYTES = 16 * 2**20

# What to do about each write failure (the flag is filled in).
_FIXES = {
    errno.ENOSPC: "free space on that disk or choose another {flag}",
    errno.EDQUOT: "free space in your quota or choose another {flag}",
    errno.EFBIG: "the file size limit was reached; raise it (ulimit -f) or choose another {flag}",
    errno.EROFS: "choose a writable {flag}",
    errno.EACCES: "choose a {flag} you may write to",
    errno.EPERM: "choose a {flag} you may write to",
    errno.ELOOP: "a symlink there leads back to itself; remove the loop or choose another {flag}",
}


def _errno_of(e: OSError) -> int | None:
    """The errno of ``e``, or of the first OSError a ``shutil.Error`` (copytree) collected."""
    code = e.errno
    if code is None and isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list):
        code = next((x[2].errno for x in e.args[0] if len(x) > 2 and isinstance(x[2], OSError)), None)
    return code


def write_failure(
    e: OSError, out: str | os.PathLike, flag: str = "--out", what: str = "the output"
) -> AnelabInputError:
    """One line for an OSError met while writing ``what`` into ``out`` (no space, read-only, permission, ...)."""
    code = _errno_of(e)
    reason = os.strerror(code) if code else type(e).__name__
    return AnelabInputError(
        f"cannot write {what} to {out}: {reason}; {_FIXES.get(code, 'check {flag}').format(flag=flag)}"
    )


def os_error_line(e: OSError) -> str | None:
    """The one line for an OSError any command may meet while writing (a full disk, a quota, a file-size limit, a
    read-only file system, a symlink loop); None for one that is a bug to show in full."""
    code = _errno_of(e)
    if code not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.ELOOP):
        return None
    where = e.filename or "a file"
    return f"cannot write {where}: {os.strerror(code)}; {_FIXES[code].format(flag='output directory')}"


def _existing_ancestor(out: Path, flag: str) -> Path:
    """The first of ``out`` and its parents that exists; refused unless it is a directory (a symlink is followed;
    a loop is refused)."""
    for parent in [out, *out.parents]:
        try:
            mode = os.stat(parent).st_mode
        except FileNotFoundError:
            if os.path.islink(parent):  # a dangling symlink: mkdir there would fail
                raise AnelabInputError(f"{flag} {out}: {parent} is a symlink to nothing; give a directory") from None
            continue
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise AnelabInputError(
                    f"{flag} {out}: {parent} is a symlink loop; {_FIXES[errno.ELOOP].format(flag=flag)}"
                ) from None
            if e.errno == errno.ENOTDIR:
                continue  # a parent further up is a file: found below
            raise write_failure(e, out, flag) from None
        if not stat.S_ISDIR(mode):
            where = "is" if parent == out else f"lies under {parent}, which is"
            raise AnelabInputError(f"{flag} {out} {where} {file_kind(mode)}, not a directory; give a directory")
        return parent
    raise AnelabInputError(f"{flag} {out}: no directory above it exists")  # unreachable for a relative path


def require_output_dir(
    out: str | os.PathLike, flag: str = "--out", need_bytes: int = MIN_FREE_BYTES, what: str = "the output"
) -> Path:
    """``out`` when it is a directory, or a path one can be made at, that this process may write on a disk with
    at least ``need_bytes`` free; else one line naming the path, what is wrong and the fix. Creates nothing."""
    out = Path(out)
    base = _existing_ancestor(out, flag)
    fs = os.statvfs(base)
    read_only, denied = fs.f_flag & os.ST_RDONLY, not os.access(base, os.W_OK | os.X_OK)
    for code, refused in ((errno.EROFS, read_only), (errno.EACCES, denied)):
        if refused:
            raise AnelabInputError(
                f"cannot write {what} to {out}: {os.strerror(code)} ({base}); {_FIXES[code].format(flag=flag)}"
            )
    free = fs.f_bavail * fs.f_frsize
    if free < need_bytes:
        raise AnelabInputError(
            f"{flag} {out}: the disk holding {base} has {human_bytes(free)} free, less than the {human_bytes(need_bytes)} "
            f"a run needs; {_FIXES[errno.ENOSPC].format(flag=flag)}"
        )
    return out


def require_output_file(path: str | os.PathLike, flag: str = "--out") -> Path:
    """``path`` when a file can be written there: not a directory or another non-file, its folder passing
    ``require_output_dir``."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        raise AnelabInputError(f"{flag} {path} is {file_kind(mode)}, not a file; give a file name")
    require_output_dir(path.parent, flag)
    return path


def make_output_dir(out: str | os.PathLike, flag: str = "--out", what: str = "the output") -> tuple[Path, bool]:
    """(``out`` as a directory, whether this call created it), after ``require_output_dir``; a failed ``mkdir``
    is one line."""
    out = require_output_dir(out, flag, what=what)
    created = not out.is_dir()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_failure(e, out, flag, what) from None
    return out, created


def _directories(root: Path) -> set[Path]:
    return {Path(d) for d, _, _ in os.walk(root)} if root.is_dir() else set()


@contextlib.contextmanager
def no_empty_dirs_left(root: str | os.PathLike, flag: str = "--out") -> Iterator[Path]:
    """Context: ``root`` made (``make_output_dir``); if the block fails or is interrupted, every directory it
    created under ``root`` (``root`` too) that is left empty is removed again, deepest first."""
    root = Path(root)
    before = _directories(root)
    root, _ = make_output_dir(root, flag)
    try:
        yield root
    except BaseException:
        for directory in sorted(_directories(root) - before, key=lambda d: len(d.parts), reverse=True):
            with contextlib.suppress(OSError):
                directory.rmdir()  # only an empty one goes
        raise
