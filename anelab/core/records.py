"""Measurement records: one JSON file per measurement, with provenance and a schema version.

A record is written once, atomically, as a new file; an existing file is never overwritten.
``origin`` says where the numbers came from: ``"measured"`` (this anelab run, on the machine in
``provenance``) or ``"recorded"`` (transcribed from a named source, e.g. the seed document's M3
tables — replayed, never fresh).

Schema (version 1)::

    {
      "schema_version": 1,
      "kind": "load_timing",                  # what was measured (free-form, snake_case)
      "origin": "measured" | "recorded",
      "provenance": {machine_model, chip, os_version, python, coremltools, numpy, anelab,
                     git_revision, date},     # strings; "unknown" where not known
      "source": {"document": ..., "record": ...} | null,   # required when origin == "recorded"
      "parameters": {...},                    # workload and settings
      "results": {...},                       # the numbers
      "unknown": ["what the source does not say", ...]
    }
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import anelab
from anelab.core.errors import AnelabInputError
from anelab.core.files import read_json
from anelab.core.macos import macos_version_text
from anelab.core.paths import REPO_ROOT

SCHEMA_VERSION = 1
ORIGINS = ("measured", "recorded")
PROVENANCE_FIELDS = (
    "machine_model",
    "chip",
    "os_version",
    "python",
    "coremltools",
    "numpy",
    "anelab",
    "git_revision",
    "date",
)
REQUIRED_FIELDS = {
    "schema_version": int,
    "kind": str,
    "origin": str,
    "provenance": dict,
    "parameters": dict,
    "results": dict,
    "unknown": list,
}


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return out or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_description() -> dict:
    """Machine model, chip and OS of this machine (macOS via sysctl and sw_vers, read once per process: two
    ``sysctl`` spawns per call would otherwise land inside whatever clock calls it; elsewhere from platform)."""
    if sys.platform == "darwin":
        return dict(_mac_description())
    chip = platform.processor() or platform.machine() or "unknown"
    return {
        "machine_model": f"{platform.system()} {platform.machine()}",
        "chip": chip,
        "os_version": f"{platform.system()} {platform.release()}",
    }


@functools.lru_cache(maxsize=1)
def _mac_description() -> dict:
    model = _run(["sysctl", "-n", "hw.model"]) or "unknown"
    chip = _run(["sysctl", "-n", "machdep.cpu.brand_string"]) or "unknown"
    os_version = "macOS " + macos_version_text()  # sw_vers, not platform.mac_ver() (16.0 in compat mode)
    return {"machine_model": model, "chip": chip, "os_version": os_version}


def machine_kind(description: dict | None = None) -> str:
    """What kind of machine a ``machine_description`` (default: this one) names, without what changes
    when the same machine is rebooted or patched: ``Linux x86_64`` (no kernel build string), or on a
    Mac ``Mac15,3 (M3), macOS 27.0`` (the OS release is part of what a Core ML measurement means)."""
    d = machine_description() if description is None else description
    model = str(d.get("machine_model", "unknown"))
    os_version = str(d.get("os_version", "unknown"))
    if not os_version.startswith("macOS"):
        return model
    chip = str(d.get("chip", "unknown")).removeprefix("Apple ")
    return f"{model} ({chip}), {os_version}"


def git_revision() -> str:
    here = REPO_ROOT
    rev = _run(["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"])
    if rev and _run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"]):
        rev += "+dirty"
    return rev or "unknown"


def provenance() -> dict:
    """Provenance of a fresh measurement taken now, on this machine."""
    import numpy

    try:
        import coremltools

        ct_version = coremltools.__version__
    except Exception:  # pragma: no cover - coremltools is a hard dependency
        ct_version = "unavailable"
    prov = machine_description()
    prov.update(
        python=platform.python_version(),
        coremltools=ct_version,
        numpy=numpy.__version__,
        anelab=anelab.__version__,
        git_revision=git_revision(),
        date=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    )
    return prov


def make_record(
    kind: str,
    parameters: dict,
    results: dict,
    *,
    origin: str = "measured",
    provenance_override: dict | None = None,
    source: dict | None = None,
    unknown: list[str] | None = None,
) -> dict:
    """Assemble a record dict (validated). Fresh measurements take this machine's provenance."""
    record = {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "origin": origin,
        "provenance": provenance_override if provenance_override is not None else provenance(),
        "source": source,
        "parameters": parameters,
        "results": results,
        "unknown": list(unknown or []),
    }
    validate_record(record, "<new record>")
    return record


def validate_record(record: object, where: str) -> dict:
    """Check a record against the schema; raise AnelabInputError naming the file and field."""
    if not isinstance(record, dict):
        raise AnelabInputError(f"{where}: a record must be a JSON object")
    for name, typ in REQUIRED_FIELDS.items():
        if name not in record:
            raise AnelabInputError(f"{where}: missing field '{name}'")
        if not isinstance(record[name], typ) or (typ is int and isinstance(record[name], bool)):
            raise AnelabInputError(f"{where}: field '{name}' must be {typ.__name__}")
    version = record["schema_version"]
    if version > SCHEMA_VERSION:
        raise AnelabInputError(
            f"{where}: field 'schema_version' is {version}, newer than this anelab reads ({SCHEMA_VERSION}); upgrade anelab"
        )
    if version < 1:
        raise AnelabInputError(f"{where}: field 'schema_version' must be >= 1")
    if record["origin"] not in ORIGINS:
        raise AnelabInputError(f"{where}: field 'origin' must be one of {', '.join(ORIGINS)}")
    for name in PROVENANCE_FIELDS:
        if not isinstance(record["provenance"].get(name), str):
            raise AnelabInputError(f"{where}: missing field 'provenance.{name}'")
    if record["origin"] == "recorded":
        source = record.get("source")
        if not isinstance(source, dict) or not source.get("document") or not source.get("record"):
            raise AnelabInputError(f"{where}: field 'source' must name the document and record of recorded data")
    return record


def atomic_write_text(path: str | os.PathLike, text: str, *, overwrite: bool = True) -> Path:
    """Write ``text`` to ``path`` atomically (see ``atomic_write_bytes``)."""
    return atomic_write_bytes(path, text.encode("utf-8"), overwrite=overwrite)


def write_record(directory: str | os.PathLike, record: dict, *, name: str | None = None) -> Path:
    """Write a validated record as a new JSON file in ``directory`` and return its path.

    The file name is ``name`` (must end in .json) or ``<kind>-<UTC timestamp>-<n>.json``, choosing
    the first free ``n``. An existing file is never overwritten.
    """
    validate_record(record, name or "<new record>")
    directory = Path(directory)
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    if name is not None:
        if not name.endswith(".json"):
            raise AnelabInputError(f"record name {name!r} must end in .json")
        return atomic_write_text(directory / name, text, overwrite=False)
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    for n in range(1, 10_000):
        try:
            return atomic_write_text(directory / f"{record['kind']}-{stamp}-{n}.json", text, overwrite=False)
        except AnelabInputError:
            continue
    raise AnelabInputError(f"no free record name in {directory}")  # pragma: no cover


def read_json_file(path: str | os.PathLike, what: str = "JSON file"):
    """Parse one regular UTF-8 JSON file (``anelab.core.files.read_json``); a missing, unreadable, special
    (a FIFO, a directory), oversized or invalid one is refused in one line."""
    return read_json(path, what)


def read_record(path: str | os.PathLike) -> dict:
    """Read and validate one record; refuse a malformed one naming the file and field."""
    return validate_record(read_json_file(path, "record file"), str(path))


def read_records(
    directory: str | os.PathLike, kind: str | None = None, *, skipped: list[tuple[Path, str]] | None = None
) -> list[dict]:
    """All records in ``directory`` (sorted by file name), optionally only one ``kind``.

    Each returned dict carries its file name under the key ``"_file"``. A malformed record is refused,
    unless ``skipped`` is given: then it is left out and (path, the one-line reason) appended there.
    """
    out = []
    for path in sorted(Path(directory).glob("*.json")):
        if path.name == "MANIFEST.json":
            continue
        try:
            record = read_record(path)
        except AnelabInputError as e:
            if skipped is None:
                raise
            skipped.append((path, str(e)))
            continue
        if kind is None or record["kind"] == kind:
            out.append({**record, "_file": path.name})
    return out


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (0o644 under the usual 022):
    a temporary file is created 0o600, and a file renamed into place keeps its mode."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, overwrite: bool = True) -> Path:
    """Write ``data`` to ``path`` via a temporary file in the same directory and rename, so a reader
    never sees a half-written file. The file gets the mode a plain ``open()`` would give it
    (readable by the group and others under the usual umask), not the temporary file's 0o600.

    With ``overwrite=False`` an existing ``path`` is refused (the new file is linked into place,
    which fails if the name is taken, so two writers cannot both win).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), new_file_mode())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise AnelabInputError(
                    f"{path} already exists; records are never overwritten — write a new record"
                ) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
