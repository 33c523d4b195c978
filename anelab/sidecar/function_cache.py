"""Converted single-function fp16 packages kept by the content of their MIL program, so one conversion serves
every weight mode and every package that holds the same function.

An export converts each function's MIL program to an fp16 package, then compresses that package when a weight
mode asks (``sidecar.quantize.compress_package``, before the merge). The conversion depends only on the program
(its ops, shapes and constant values) and the code that converts it (``core.code_identity``: anelab's source, coremltools):
``program_digest`` hashes exactly those, and ``converted_function`` converts a program once per digest into
``<cache>/<digest>.mlpackage``. Four modes of one layer then cost one conversion and three compressions, and the
``h0`` and ``h<P-C>`` of a package holding only its two ends are the full package's own (same coverage, same
RoPE table). An entry appears by a rename of a finished conversion: a reader never sees half of one; a process
asking for a program another is converting waits for it (a lock per program) instead of converting it again.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from anelab.core.code_identity import code_identity
from anelab.core.files import entry_lock

# pymil numbers the names it makes up (``q_proj_weight_0``, ``reshape_3``, ``block0``) from counters that run on
# across the programs one process builds: the same program built twice differs only there
GENERATED_NAME = re.compile(r"\b[A-Za-z_][\w.]*_\d+\b")
BLOCK_NAME = re.compile(r"\bblock\d+\(")


def canonical_text(prog) -> str:
    """The program's text with pymil's made-up names numbered in order of first appearance (names the builder gave,
    such as inputs, outputs and the projections' ``q_proj``, are kept)."""
    names: dict[str, str] = {}
    text = BLOCK_NAME.sub("block(", str(prog))
    return GENERATED_NAME.sub(lambda m: names.setdefault(m.group(0), f"_generated_{len(names)}"), text)


def program_digest(prog) -> str:
    """SHA-256 (32 hex digits) of a pymil program: its ``canonical_text`` (ops, shapes, dtypes, the builder's names),
    each function's input and output names as they are, and every constant's value in op order (dtype, shape and
    bytes; the text abbreviates them), with the code that converts it (``core.code_identity``)."""
    digest = hashlib.sha256(f"{code_identity()}\n{canonical_text(prog)}".encode())
    for name, function in sorted(prog.functions.items()):
        # the interface exactly, whatever its names look like: inputs and outputs are what a caller binds by name
        digest.update(f"{name}({','.join(function.inputs)}) -> {','.join(v.name for v in function.outputs)}".encode())
        for op in function.find_ops(op_type="const"):
            value = np.asarray(op.outputs[0].val)
            digest.update(f"{name}:{value.dtype}{value.shape}".encode())
            digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()[:32]


def converted_function(
    prog, dest: Path, cache: str | os.PathLike | None, convert: Callable[[object, Path], Path]
) -> Path:
    """The fp16 package of ``prog``: ``convert(prog, dest)`` without a ``cache``; with one, the package converted from
    the same program before (``cache/<program_digest>.mlpackage``, converted now when missing). The returned
    package is read, never written, by the caller (a compression writes a new one)."""
    if cache is None:
        return convert(prog, dest)
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    entry = cache / f"{program_digest(prog)}.mlpackage"
    if entry.is_dir():
        return entry
    with entry_lock(entry.with_suffix(".lock")):  # one conversion per program: a second process waits, then reads it
        if entry.is_dir():
            return entry
        staging = Path(tempfile.mkdtemp(prefix=".convert.", dir=cache))
        try:
            convert(prog, staging / "function.mlpackage")
            try:
                os.rename(staging / "function.mlpackage", entry)
            except OSError:  # stored meanwhile by a process that took no lock: its package is the same
                if not entry.is_dir():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return entry
