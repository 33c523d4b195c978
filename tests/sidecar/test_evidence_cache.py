"""The shared export / verification cache (``anelab.sidecar.checks.evidence_cache``): reused by content, recomputed when
any input it depends on changes, with controls (a changed package, other weights, another mode, other inputs)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_GEOMETRIES, TINY_MODEL_TYPES

from anelab.checkpoints.checkpoint import load_checkpoint, write_checkpoint
from anelab.core.weights import random_attention_weights
from anelab.sidecar.checks import evidence_cache
from anelab.sidecar.checks.verify import verify_package

VARIANT = "llama"
LAYER = TINY_GEOMETRIES[VARIANT].full_attention_layers[-1]


@pytest.fixture(scope="module")
def cache(tiny_checkpoint, tmp_path_factory):
    return tiny_checkpoint(VARIANT), tmp_path_factory.mktemp("cache")


def test_an_export_is_made_once_and_reused_by_content(cache, tmp_path):
    ckpt, root = cache
    use = evidence_cache.CacheUse()
    [first] = evidence_cache.cached_export(
        load_checkpoint(ckpt), root, 8, [0, 8], [LAYER], weights_mode="int8", use=use
    )
    stamp = first.package.stat().st_mtime_ns
    [again] = evidence_cache.cached_export(
        load_checkpoint(ckpt), root, 8, [0, 8], [LAYER], weights_mode="int8", use=use
    )
    assert again.package == first.package and again.package.stat().st_mtime_ns == stamp
    assert again.functions == ["h0", "h8"] and again.metadata.weights == "int8"
    assert use.reused == {"export": 1} and use.computed == {"export": 1}
    assert use.line() == "export: 1 reused, 1 computed"
    # controls: another mode, another request, a copy of the checkpoint elsewhere (same tensors: reused)
    [fp16] = evidence_cache.cached_export(load_checkpoint(ckpt), root, 8, [0, 8], [LAYER], weights_mode="fp16", use=use)
    [other] = evidence_cache.cached_export(load_checkpoint(ckpt), root, 8, [0], [LAYER], weights_mode="int8", use=use)
    assert len({first.package.parent, fp16.package.parent, other.package.parent}) == 3
    g = TINY_GEOMETRIES[VARIANT]
    weights = {i: random_attention_weights(g, i, 0) for i in g.full_attention_layers}
    changed = write_checkpoint(tmp_path / "other", g, weights, model_type=TINY_MODEL_TYPES[VARIANT])
    [moved] = evidence_cache.cached_export(load_checkpoint(changed), root, 8, [0, 8], [LAYER], weights_mode="int8")
    assert moved.package.parent != first.package.parent  # other weights, other entry


def test_a_changed_package_is_exported_again(cache):
    ckpt, root = cache
    [r] = evidence_cache.cached_export(load_checkpoint(ckpt), root, 8, [0], [LAYER], weights_mode="fp16")
    weight = next(p for p in r.package.rglob("*.bin"))
    weight.write_bytes(weight.read_bytes()[:-4] + b"\0\0\0\0")
    use = evidence_cache.CacheUse()
    [again] = evidence_cache.cached_export(load_checkpoint(ckpt), root, 8, [0], [LAYER], weights_mode="fp16", use=use)
    assert use.computed == {"export": 1} and again.package == r.package
    assert verify_package(again.package, load_checkpoint(ckpt)).passed


def test_a_verification_is_reused_and_keyed_by_its_inputs(cache):
    ckpt, root = cache
    [r] = evidence_cache.cached_export(load_checkpoint(ckpt), root, 8, [0, 8], [LAYER], weights_mode="int8")
    use = evidence_cache.CacheUse()
    first = evidence_cache.cached_verify(r.package, load_checkpoint(ckpt), root, use=use)
    again = evidence_cache.cached_verify(r.package, load_checkpoint(ckpt), root, use=use)
    assert use.reused == {"verify": 1} and use.computed == {"verify": 1}
    assert first.passed and again.passed and again.table().splitlines()[:-1] == first.table().splitlines()[:-1]
    assert [c.cost for c in again.comparisons] == [c.cost for c in first.comparisons]
    assert again.missing_controls == [] and again.to_dict()["comparisons"] == first.to_dict()["comparisons"]
    # controls: other options or real inputs are another verification
    evidence_cache.cached_verify(r.package, load_checkpoint(ckpt), root, use=use, seed=1)
    rows = np.random.default_rng(0).standard_normal((16, TINY_GEOMETRIES[VARIANT].hidden_size)).astype(np.float16)
    real = evidence_cache.cached_verify(r.package, load_checkpoint(ckpt), root, use=use, activations=rows)
    assert use.computed == {"verify": 3} and real.inputs.startswith("real attention inputs")
    assert evidence_cache.activations_digest(rows) != evidence_cache.activations_digest(rows[::-1])


def test_results_cached_by_other_code_are_computed_again(cache, monkeypatch):
    """The same inputs under a changed anelab source (or NumPy / coremltools) are not the same results: an export
    and a verification cached by other code are made again (a figure once drew verifications an older reference had
    computed). Control: the same code reuses both."""
    ckpt, root = cache
    [r] = evidence_cache.cached_export(load_checkpoint(ckpt), root, 8, [0], [LAYER], weights_mode="fp16")
    evidence_cache.cached_verify(r.package, load_checkpoint(ckpt), root)
    use = evidence_cache.CacheUse()
    [same] = evidence_cache.cached_export(load_checkpoint(ckpt), root, 8, [0], [LAYER], weights_mode="fp16", use=use)
    evidence_cache.cached_verify(same.package, load_checkpoint(ckpt), root, use=use)
    assert use.reused == {"export": 1, "verify": 1} and use.computed == {}  # control: same code, reused
    monkeypatch.setattr(evidence_cache, "code_identity", lambda: "anelab 0.1.0 (source 0123456789abcdef)")
    use = evidence_cache.CacheUse()
    [fresh] = evidence_cache.cached_export(load_checkpoint(ckpt), root, 8, [0], [LAYER], weights_mode="fp16", use=use)
    evidence_cache.cached_verify(fresh.package, load_checkpoint(ckpt), root, use=use)
    assert use.computed == {"export": 1, "verify": 1} and use.reused == {}
    assert fresh.package.parent != r.package.parent
