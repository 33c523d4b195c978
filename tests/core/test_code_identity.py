"""``core.code_identity``: the key of every result kept between runs changes with the source that computes it."""

from __future__ import annotations

import shutil
from pathlib import Path

import anelab
from anelab.core.code_identity import code_identity, source_digest


def test_the_source_digest_moves_with_any_source_file_and_only_with_one(tmp_path):
    tree = tmp_path / "anelab"
    shutil.copytree(Path(anelab.__file__).parent, tree, ignore=shutil.ignore_patterns("__pycache__"))
    digest = source_digest(tree)
    assert digest == source_digest(Path(anelab.__file__).parent)  # the copy is the package's source
    (tree / "notes.txt").write_text("not source")
    assert source_digest(tree) == digest  # control: a file that is not Python source does not move it
    reference = tree / "core" / "reference.py"
    reference.write_text(reference.read_text() + "\n# one comment\n")
    assert source_digest(tree) != digest
    reference.rename(tree / "core" / "reference_moved.py")
    moved = source_digest(tree)
    assert moved != digest
    assert len({moved, source_digest(tree / "core")}) == 2  # another root, another digest


def test_the_identity_names_the_version_the_source_and_the_computing_libraries():
    import coremltools
    import numpy

    identity = code_identity()
    assert identity.startswith(f"anelab {anelab.__version__} (source {source_digest()})")
    assert f"numpy {numpy.__version__}" in identity and f"coremltools {coremltools.__version__}" in identity
