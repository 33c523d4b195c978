"""Reading the user's files: regular files only, sizes bounded, UTF-8 JSON parsed in one line's refusal.

Every file anelab reads on a user's say-so (config.json, a shard index, a token file, a record, a package's
Manifest.json) is opened without blocking and refused unless it is a regular file: a FIFO would block
``open()`` forever, a directory or a device is not a file. A file larger than its reader's bound is refused
before it is read (the limit and the size are named), and JSON that is not UTF-8, not valid or nested past
what Python's parser can recurse through is refused in one line, never echoing the file's bytes.
``confined`` resolves a path (symlinks included) and refuses one that leaves its directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
from pathlib import Path
from typing import BinaryIO

from anelab.core.errors import AnelabInputError

MAX_JSON_BYTES = 64 * 2**20  # config.json, an index, a token list, a record: the largest real ones are ~10 MB


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words ("a regular file", "a FIFO", ...)."""
    return next((kind for test, kind in _KINDS if test(mode)), "a regular file" if stat.S_ISREG(mode) else "special")


def open_regular(path: str | os.PathLike, what: str) -> BinaryIO:
    """``path`` opened for binary reading, refused (one line) unless it is a regular file: opened with
    ``O_NONBLOCK`` so a FIFO cannot block, checked with ``fstat`` (the file opened, not a name raced)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise AnelabInputError(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise AnelabInputError(f"{path}: not a {what} (a directory; give the file itself)") from None
    except PermissionError:
        raise AnelabInputError(f"{path}: permission denied reading the {what}") from None
    except OSError as e:
        raise AnelabInputError(f"{path}: cannot open the {what} ({os.strerror(e.errno or errno.EIO)})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise AnelabInputError(f"{path}: not a {what} ({file_kind(mode)}, not a regular file; give the file itself)")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "rb")


def read_bytes(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (a larger one is refused before it is read)."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise AnelabInputError(f"{path}: the {what} is {size:,} bytes; the limit is {limit:,} bytes")
        return f.read(limit + 1)[:limit]


def decode_utf8(data: bytes, where: str, what: str) -> str:
    """``data`` as UTF-8 text; refused naming the first bad byte's offset (never the byte)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise AnelabInputError(f"{where}: the {what} is not UTF-8 text (bad byte at offset {e.start})") from None


def parse_json(text: str, where: str, what: str):
    """``text`` parsed as JSON; invalid or too deeply nested JSON is refused in one line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        kind = "" if what.endswith("file") else f"{what} "  # "not valid notebook JSON", "not valid JSON"
        raise AnelabInputError(f"{where}: not valid {kind}JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise AnelabInputError(f"{where}: the {what} nests its JSON too deeply to parse; it is malformed") from None


def read_json(path: str | os.PathLike, what: str = "JSON file", limit: int = MAX_JSON_BYTES):
    """One regular UTF-8 JSON file of at most ``limit`` bytes, parsed; anything else refused in one line."""
    return parse_json(decode_utf8(read_bytes(path, what, limit), str(path), what), str(path), what)


def resolved_path(path: str | os.PathLike, what: str) -> Path:
    """``path`` with every symlink resolved; a symlink loop (or a chain too long to follow) is refused in one line."""
    try:
        return Path(path).resolve()
    except RuntimeError:  # Python 3.11's pathlib: "Symlink loop from ..."
        raise AnelabInputError(f"{what} {path} is a symlink loop; replace it with the file itself") from None
    except OSError as e:  # ELOOP from the kernel, or a path component that cannot be read
        raise AnelabInputError(f"{what} {path} cannot be resolved ({os.strerror(e.errno or errno.EIO)})") from None


def confined(path: str | os.PathLike, root: str | os.PathLike, what: str, *, also: tuple[Path, ...] = ()) -> Path:
    """``path`` with every symlink resolved, refused unless it lies inside ``root`` (resolved too) or one of
    ``also``; the refusal names the path as given and where it leads, never the file's contents."""
    root = resolved_path(root, what)
    resolved = resolved_path(path, what)
    for allowed in (root, *(resolved_path(a, what) for a in also)):
        if resolved == allowed or resolved.is_relative_to(allowed):
            return resolved
    raise AnelabInputError(f"{what} {path} leads to {resolved}, outside {root}; a checkpoint's files stay inside it")


@contextlib.contextmanager
def entry_lock(path: Path, wait: bool = True):
    """An exclusive ``flock`` on ``path`` (created), held for the block: one writer of an entry at a time. Yields
    True once held; with ``wait=False`` it yields False at once when another process holds it (nothing held)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
