"""Sidecars matched to a checkpoint by content: the package records the absolute path and a digest per attention tensor.

A byte-identical copy under another name (or a Hugging Face cache's new ``snapshots/<revision>/``) is
accepted by ``compare-arms`` and ``verify``; a copy with one tensor changed is refused in one line
naming that tensor (the negative control).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from anelab.arms.sidecars import open_sidecars
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.whole_model import load_model, write_model_checkpoint
from anelab.core.decoder import random_head_weights, random_layer_weights
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.weights import random_attention_weights
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import read_sidecar_metadata

CHUNK = 4
GEOMETRY = AttentionGeometry("llama", 16, 2, 1, 8, num_layers=2, full_attention_layers=(0, 1))
CHANGED = "model.layers.1.self_attn.v_proj.weight"


def _write(path, *, nudge_v1: bool = False):
    g = GEOMETRY
    attention = {i: random_attention_weights(g, i, 5) for i in (0, 1)}
    if nudge_v1:
        attention[1].v_proj = attention[1].v_proj.copy()
        attention[1].v_proj[0, 0] += 0.25
    layers = {i: random_layer_weights(i, 16, 24, 5) for i in (0, 1)}
    head = random_head_weights(32, 16, 5, tied=True)
    return write_model_checkpoint(path, g, attention, layers, head, model_type="llama", dtype="BF16", shards=2)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("content")
    original = _write(root / "models--org--m" / "snapshots" / "rev1")
    export_sidecars(load_checkpoint(original), root / "sidecars", CHUNK, [0, CHUNK])
    renamed = root / "models--org--m" / "snapshots" / "rev2"  # a new revision with the same tensors
    shutil.copytree(original, renamed)
    other = _write(root / "edited")
    changed = _write(root / "changed", nudge_v1=True)
    return root, original, renamed, other, changed


def test_the_package_records_the_absolute_path_and_one_digest_per_attention_tensor(exported, tmp_path, monkeypatch):
    root, original, *_ = exported
    meta = read_sidecar_metadata(root / "sidecars" / "layer_1.mlpackage")
    assert meta.source == str(original.resolve())
    names = {f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkvo"}
    assert set(meta.source_tensors) == names and len(set(meta.source_tensors.values())) == 4
    monkeypatch.chdir(original.parent)
    relative = load_checkpoint("rev1")  # a relative path, recorded absolute
    export_sidecars(relative, tmp_path / "relative", CHUNK, [0], layers=[0])
    assert read_sidecar_metadata(tmp_path / "relative" / "layer_0.mlpackage").source == str(original.resolve())


def test_a_renamed_copy_with_the_same_tensors_is_accepted(exported):
    root, original, renamed, *_ = exported
    sidecars = open_sidecars(root / "sidecars", load_model(renamed), prompt_tokens=2 * CHUNK)
    assert sorted(sidecars.packages) == [0, 1]
    assert verify_package(root / "sidecars" / "layer_1.mlpackage", load_checkpoint(renamed)).passed


def test_the_same_geometry_with_one_tensor_changed_is_refused_naming_it(exported):
    """Negative controls: an identical rewrite is accepted, one changed element of v_proj is named."""
    root, _, _, same, changed = exported
    assert open_sidecars(root / "sidecars", load_model(same), prompt_tokens=CHUNK).chunk == CHUNK
    with pytest.raises(AnelabInputError, match=f"tensor {CHANGED} differs") as e:
        open_sidecars(root / "sidecars", load_model(changed), prompt_tokens=CHUNK)
    assert "\n" not in str(e.value)
    with pytest.raises(AnelabInputError, match=f"tensor {CHANGED} differs"):
        verify_package(root / "sidecars" / "layer_1.mlpackage", load_checkpoint(changed))


def test_digests_are_of_stored_bytes_not_of_the_path(exported):
    _, original, renamed, _, changed = exported
    digests = load_checkpoint(original).attention_digests(1)
    assert load_checkpoint(renamed).attention_digests(1) == digests
    moved = load_checkpoint(changed).attention_digests(1)
    assert [n for n in digests if digests[n] != moved[n]] == [CHANGED]
    assert np.array_equal(load_checkpoint(changed).layer(0).q_proj, load_checkpoint(original).layer(0).q_proj)


def test_digesting_a_layer_releases_each_tensors_pages(tmp_path, monkeypatch):
    """Matching an 8B model's sidecars digests 2.7 GB of attention tensors through memory maps: each tensor's
    mapped pages are released once hashed (without it compare-arms held 2.2 GB of file pages)."""
    from anelab.checkpoints.safetensors_io import SafetensorsFile

    checkpoint = load_checkpoint(_write(tmp_path / "m"))
    released = []
    real = SafetensorsFile.release
    monkeypatch.setattr(SafetensorsFile, "release", lambda self, name=None: released.append(name) or real(self, name))
    digests = checkpoint.attention_digests(1)
    assert sorted(released) == sorted(digests) and len(digests) == 4
