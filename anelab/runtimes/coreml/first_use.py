"""The tiny model that pays a process's first Core ML load and predict before any clock starts."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from anelab.sidecar.coremltools_import import coremltools_modules
from anelab.sidecar.export import convert_program


def first_use_package() -> Path:
    """A tiny model (``y = x * 2``, fp16 [1, 8]) that pays a process's first Core ML load and predict before any
    clock starts; built once per machine and coremltools version (in the temporary directory: no project file
    is written) and reused."""
    from importlib.metadata import version

    where = Path(tempfile.gettempdir()) / f"anelab-first-use-coremltools-{version('coremltools')}"
    FIRST_USE_PACKAGE = where / "anelab_first_use.mlpackage"  # noqa: N806 - one fixed path
    if (FIRST_USE_PACKAGE / "Manifest.json").is_file():
        return FIRST_USE_PACKAGE

    ct, mb, types = coremltools_modules()

    @mb.program(input_specs=[mb.TensorSpec((1, 8), types.fp16)], opset_version=ct.target.iOS18)
    def double(x):
        return mb.mul(x=x, y=mb.const(val=np.full((1, 8), 2.0, np.float16)), name="y")

    FIRST_USE_PACKAGE.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".first-use.", dir=FIRST_USE_PACKAGE.parent))
    try:
        built = convert_program(double, work / FIRST_USE_PACKAGE.name)
        try:
            os.replace(built, FIRST_USE_PACKAGE)
        except OSError:  # another process built it first
            if not (FIRST_USE_PACKAGE / "Manifest.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return FIRST_USE_PACKAGE
