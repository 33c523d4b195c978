"""One fp16 conversion per MIL program, shared by every weight mode and package (anelab.sidecar.function_cache)."""

from __future__ import annotations

import dataclasses

from conftest import TINY_GEOMETRIES

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.sidecar import export as export_module
from anelab.sidecar.export import export_sidecars, function_builds
from anelab.sidecar.format import WEIGHTS_RELATIVE, read_sidecar_metadata
from anelab.sidecar.function_cache import program_digest

CHUNK = 8
LAYER = TINY_GEOMETRIES["llama"].full_attention_layers[-1]


def counted_conversions(monkeypatch) -> list:
    calls = []
    real = export_module.convert_program

    def convert(prog, dest):
        calls.append(dest)
        return real(prog, dest)

    monkeypatch.setattr(export_module, "convert_program", convert)
    return calls


def weight_file(pkg):
    return (pkg / WEIGHTS_RELATIVE).read_bytes()


def test_modes_and_ends_share_one_conversion_per_function(tiny_checkpoint, tmp_path, monkeypatch):
    """fp16 over h0, h8, h16 converts three programs; int8 over the ends (h0, h16) converts none: its package is the
    one exported without the cache."""
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    cache = tmp_path / "functions"
    calls = counted_conversions(monkeypatch)
    runs = [("fp16", [0, CHUNK, 2 * CHUNK]), ("int8", [0, 2 * CHUNK])]
    cached = {
        mode: export_sidecars(ckpt, tmp_path / f"c-{mode}", CHUNK, h, [LAYER], weights_mode=mode, function_cache=cache)
        for mode, h in runs
    }
    assert len(calls) == 3 and len(list(cache.glob("*.mlpackage"))) == 3
    calls.clear()
    plain = {
        mode: export_sidecars(ckpt, tmp_path / f"p-{mode}", CHUNK, h, [LAYER], weights_mode=mode) for mode, h in runs
    }
    assert len(calls) == 5  # without the cache every function of every mode converts (3 + 2)
    for mode, _ in runs:
        [c], [p] = cached[mode], plain[mode]
        assert weight_file(c.package) == weight_file(p.package), mode
        assert c.functions == p.functions and c.metadata.weights == p.metadata.weights == mode


def test_program_digest_follows_every_constant(tiny_checkpoint):
    """The same program digests alike; one weight element changed, or another function of the package, does not."""
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    g, w = ckpt.geometry, ckpt.layer(LAYER)
    builds = function_builds(g, w, "dense", CHUNK, [0, CHUNK])
    first = program_digest(builds["h0"]())
    assert program_digest(function_builds(g, w, "dense", CHUNK, [0, CHUNK])["h0"]()) == first
    assert program_digest(builds["h8"]()) != first
    changed = w.k_proj.copy()
    changed[3, 5] += 0.5
    moved = dataclasses.replace(w, k_proj=changed)
    assert program_digest(function_builds(g, moved, "dense", CHUNK, [0, CHUNK])["h0"]()) != first


def test_a_cached_package_is_its_uncached_twin(tiny_checkpoint, tmp_path):
    """Read back from the cache, a layer's package stores the same weights and records the same functions as one
    exported without it."""
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    [a] = export_sidecars(ckpt, tmp_path / "a", CHUNK, [0, CHUNK], [LAYER], function_cache=tmp_path / "functions")
    [b] = export_sidecars(ckpt, tmp_path / "b", CHUNK, [0, CHUNK], [LAYER], function_cache=tmp_path / "functions")
    [c] = export_sidecars(ckpt, tmp_path / "c", CHUNK, [0, CHUNK], [LAYER])
    assert weight_file(a.package) == weight_file(b.package) == weight_file(c.package)
    metas = [read_sidecar_metadata(r.package) for r in (a, b, c)]
    assert all(m.functions == metas[2].functions and m.coverage == metas[2].coverage for m in metas)


def test_a_program_another_process_is_converting_is_waited_for_not_converted_again(tiny_checkpoint, tmp_path):
    """Another worker holds the program's lock while it converts: this one waits and reads its package; the converter
    is not called here. Control: with the lock free, the program is converted here."""
    import threading
    import time

    from anelab.core.files import entry_lock
    from anelab.sidecar.function_cache import converted_function

    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    [build, *_] = function_builds(ckpt.geometry, ckpt.layer(LAYER), "dense", CHUNK, [0]).values()
    cache = tmp_path / "functions"
    entry = cache / f"{program_digest(build())}.mlpackage"
    calls = []

    def convert(prog, dest):
        calls.append(dest)
        return export_module.convert_program(prog, dest)

    holding, done = threading.Event(), threading.Event()
    cache.mkdir()
    theirs = export_module.convert_program(build(), tmp_path / "theirs.mlpackage")  # here: coremltools is one thread's

    def other_worker():  # stores its conversion under the lock, as a second process would
        with entry_lock(entry.with_suffix(".lock")):
            holding.set()
            time.sleep(0.3)
            theirs.rename(entry)
        done.set()

    worker = threading.Thread(target=other_worker)
    worker.start()
    assert holding.wait(60)
    assert converted_function(build(), tmp_path / "mine.mlpackage", cache, convert) == entry
    worker.join()
    assert done.is_set() and calls == []  # waited for theirs, converted nothing
    other = function_builds(ckpt.geometry, ckpt.layer(LAYER), "dense", CHUNK, [0, CHUNK])["h8"]
    converted_function(other(), tmp_path / "other.mlpackage", cache, convert)
    assert len(calls) == 1  # control: a program nobody holds is converted here
