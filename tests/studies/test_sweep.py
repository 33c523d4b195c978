"""The chunk-size sweep (anelab.studies.tiled_stateful).

Expected values are derived independently: by hand for a tiny geometry (arithmetic written out
below), from the seed's own numbers for Qwen 3.8's geometry, and — for the setup column — by
re-fitting the recorded loads in this file rather than through anelab.planner. Each check has a
negative control: the same comparison against a sweep of a wrong input must fail.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.records import read_record
from anelab.sidecar.prompt import prefill_prompt, prompt_reference
from anelab.studies.tiled_stateful import (
    DESIGNS,
    SEED_UTILIZATION_CLAIM,
    chunk_sweep,
    export_design_grid,
    export_designs,
    numpy_prefill_record,
    package_facts,
    seed_utilization_table,
    time_numpy_prefill,
)

DATA = Path(__file__).resolve().parents[2] / "data"
FP16_THRESHOLD = 1e-2  # anelab.sidecar.checks.comparison's relative-error threshold for fp16 packages

# heads 2, head_dim 4, hidden 8, one KV head; full-attention layers 0 and 2 (two of three)
TINY = AttentionGeometry(
    variant="llama", hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, num_layers=3, full_attention_layers=(0, 2)
)
PROMPT = 10
CHUNKS = (4, 8, 16)
TILE = 2

# Hand arithmetic for TINY, P = 10 (fp16 = 2 bytes; FLOPs per score entry = head_dim 4 x 2 x 2 = 16):
#   C=4 : calls ceil(10/4)=3, coverage 12, starts 0,4,8
#         dense arena 2*4*(8+4)*2 = 192; tiled 2*4*2*2 = 32; stateful 2*4*12*2 = 192
#         score entries 2*4*(4+8+12) = 192 -> 3072 FLOPs; stateful 3*2*4*12 = 288 -> 4608
#   C=8 : calls 2, coverage 16; dense 2*8*16*2 = 512; tiled 2*8*2*2 = 64; stateful 512
#         entries 2*8*(8+16) = 384 -> 6144; stateful 2*2*8*16 = 512 -> 8192
#   C=16: calls 1, coverage 16 (prompt shorter than the chunk: stays on the GPU)
#         dense 2*16*16*2 = 1024; tiled 2*16*2*2 = 128; stateful 1024
#         entries 2*16*16 = 512 -> 8192; stateful the same
#   causal minimum: 2 heads * 16 * (10*11/2 = 55) = 1760
#   weights: q 8x8 + k 4x8 + v 4x8 + o 8x8 = 192 parameters -> 384 bytes
HAND = {
    4: dict(
        calls=3,
        coverage=12,
        on_ane=True,
        dense_variants_per_layer=3,
        dense_variants=6,
        stateful_functions_per_layer=1,
        stateful_functions=2,
        dense_arena_bytes=192,
        key_tile=2,
        tiled_arena_bytes=32,
        stateful_arena_bytes=192,
        score_flops=3072,
        stateful_score_flops=4608,
        causal_score_flops=1760,
        weight_bytes=384,
    ),
    8: dict(
        calls=2,
        coverage=16,
        on_ane=True,
        dense_variants_per_layer=2,
        dense_variants=4,
        stateful_functions_per_layer=1,
        stateful_functions=2,
        dense_arena_bytes=512,
        key_tile=2,
        tiled_arena_bytes=64,
        stateful_arena_bytes=512,
        score_flops=6144,
        stateful_score_flops=8192,
        causal_score_flops=1760,
        weight_bytes=384,
    ),
    16: dict(
        calls=1,
        coverage=16,
        on_ane=False,
        dense_variants_per_layer=1,
        dense_variants=2,
        stateful_functions_per_layer=1,
        stateful_functions=2,
        dense_arena_bytes=1024,
        key_tile=2,
        tiled_arena_bytes=128,
        stateful_arena_bytes=1024,
        score_flops=8192,
        stateful_score_flops=8192,
        causal_score_flops=1760,
        weight_bytes=384,
    ),
}
# arenas (bytes) of the dense functions h0, hC, ... and of the stateful function, per chunk
HAND_DENSE_ARENAS = {4: [64, 128, 192], 8: [256, 512], 16: [1024]}
HAND_STATEFUL_ARENA = {4: 192, 8: 512, 16: 1024}


def mismatches(rows: list[dict], hand: dict) -> list[str]:
    """Columns of ``rows`` that differ from the hand-computed table."""
    out = []
    by_chunk = {r["chunk"]: r for r in rows}
    for chunk, expected in hand.items():
        row = by_chunk.get(chunk)
        if row is None:
            out.append(f"chunk {chunk} missing")
            continue
        out += [f"C={chunk} {k}: {row[k]} != {v}" for k, v in expected.items() if row[k] != v]
    return out


def recorded_power_law() -> tuple[float, float, float]:
    """(a, b, r): a cold load = a (arena/GB)^b (specialization) + r arena/GB (reload), re-fitted here on the
    records (issue 30): r = TinyTitan's ~0.5 s per layer-chunk at the 35B's mean visited arena (16 heads,
    h0 and h4096); a, b minimise the squared log misses of Qwen 3.8's cold loads (variants and package
    compositions, less their reload) and of the 35B's ~130 s over its 40 functions (h0..h12288, 10 layers)."""
    rec = json.loads((DATA / "seed-38-variant-loads.json").read_text())
    comp = json.loads((DATA / "seed-38-package-composition-loads.json").read_text())
    heads, chunk = rec["parameters"]["heads"], rec["parameters"]["chunk"]
    r = 0.5 / ((16 * 4096 * 4096 * 2 + 16 * 4096 * 8192 * 2) / 2 / 1e9)
    points = [(heads * chunk * (x["history"] + chunk) * 2 / 1e9, x["seconds"]) for x in rec["results"]["loads"]]
    points += [(heads * chunk * chunk * 2 / 1e9, x["seconds"]) for x in comp["results"]["loads"]]
    points = [(g, s - r * g) for g, s in points]
    total = [16 * 4096 * (h + 4096) * 2 / 1e9 for h in (0, 4096, 8192, 12288)] * 10
    best = None
    for b in np.arange(0.25, 3.0001, 0.005):
        logs = [math.log(s) - b * math.log(g) for g, s in points] + [
            math.log(130.0) - math.log(sum(g**b for g in total))
        ]
        log_a = sum(logs) / len(logs)
        miss = sum((v - log_a) ** 2 for v in logs)
        if best is None or miss < best[0] - 1e-12:
            best = (miss, math.exp(log_a), float(b))
    return best[1], best[2], r


def test_every_column_matches_the_hand_computed_tiny_case():
    rows = chunk_sweep(TINY, PROMPT, CHUNKS, key_tile=TILE)
    assert [r["chunk"] for r in rows] == list(CHUNKS)
    assert mismatches(rows, HAND) == []
    assert all(r["weight_bytes_source"].startswith("computed") for r in rows)


@pytest.mark.parametrize(
    "wrong",
    [
        dict(
            geometry=AttentionGeometry(
                variant="llama",
                hidden_size=8,
                num_heads=3,
                num_kv_heads=1,
                head_dim=4,
                num_layers=3,
                full_attention_layers=(0, 2),
            ),
            prompt=PROMPT,
        ),
        dict(geometry=TINY, prompt=PROMPT - 1),
        dict(
            geometry=AttentionGeometry(
                variant="llama",
                hidden_size=8,
                num_heads=2,
                num_kv_heads=1,
                head_dim=4,
                num_layers=3,
                full_attention_layers=(0,),
            ),
            prompt=PROMPT,
        ),
    ],
    ids=["three heads", "prompt 9", "one full-attention layer"],
)
def test_negative_control_a_wrong_input_fails_the_hand_table(wrong):
    rows = chunk_sweep(wrong["geometry"], wrong["prompt"], CHUNKS, key_tile=TILE)
    assert mismatches(rows, HAND), "the hand table would accept a sweep of the wrong input"


def test_setup_prices_each_visited_function_with_the_recorded_load_fit():
    a, b, r = recorded_power_law()
    n_layers = len(TINY.full_attention_layers)
    rows = {r["chunk"]: r for r in chunk_sweep(TINY, PROMPT, CHUNKS, key_tile=TILE, data_dir=DATA)}
    for chunk, arenas in HAND_DENSE_ARENAS.items():
        dense = n_layers * sum(a * (x / 1e9) ** b + r * x / 1e9 for x in arenas)
        stateful = n_layers * (a * (HAND_STATEFUL_ARENA[chunk] / 1e9) ** b + r * HAND_STATEFUL_ARENA[chunk] / 1e9)
        assert rows[chunk]["dense_setup_seconds"] == pytest.approx(dense, rel=1e-9)
        assert rows[chunk]["stateful_setup_seconds"] == pytest.approx(stateful, rel=1e-9)
        assert rows[chunk]["dense_setup_extrapolated"] and rows[chunk]["stateful_setup_extrapolated"]  # bytes vs GB
    # negative control: pricing one history too few (C=4: h0, h4 only) is detectably different
    assert rows[4]["dense_setup_seconds"] != pytest.approx(
        n_layers * sum(a * (x / 1e9) ** b for x in [64, 128]), rel=1e-6
    )


def test_decode_function_adds_one_function_and_its_load():
    a, b, r = recorded_power_law()
    row = chunk_sweep(TINY, PROMPT, (4,), key_tile=TILE, decode=True, data_dir=DATA)[0]
    assert (row["stateful_functions_per_layer"], row["stateful_functions"]) == (2, 4)
    # c4 arena 2*4*12*2 = 192 bytes; c1 arena 2*1*12*2 = 48 bytes
    cold = a * ((192 / 1e9) ** b + (48 / 1e9) ** b) + r * (192 + 48) / 1e9
    assert row["stateful_setup_seconds"] == pytest.approx(2 * cold, rel=1e-9)


def test_load_floor_prices_every_small_load_at_the_floor():
    rows = {r["chunk"]: r for r in chunk_sweep(TINY, PROMPT, CHUNKS, key_tile=TILE, load_floor_seconds=0.1)}
    assert rows[4]["dense_setup_seconds"] == pytest.approx(2 * 3 * 0.1)  # 2 layers x 3 histories
    assert rows[8]["dense_setup_seconds"] == pytest.approx(2 * 2 * 0.1)
    assert rows[4]["stateful_setup_seconds"] == pytest.approx(2 * 0.1)
    assert rows[4]["setup_sources"] == ["floor"]


def test_seed_geometry_reproduces_the_seeds_variants_and_setup():
    """Qwen 3.8 at the seed's workload: 4,333 tokens, chunk 4,096, 12 full-attention layers of 24 heads.
    Seed: 24 (layer, history) variants; loads 6.7 s (h0) + 13.6 s (h4096) per layer, '24 variant loads
    ~ 245 s'; 4,096 x 8,192 score entries per head at h4096 (a 1.6 GB fp16 arena)."""
    g = AttentionGeometry(
        variant="llama",
        hidden_size=1024,
        num_heads=24,
        num_kv_heads=4,
        head_dim=256,
        num_layers=48,
        full_attention_layers=tuple(range(3, 48, 4)),
    )
    row = chunk_sweep(g, 4333, (4096,), data_dir=DATA)[0]
    assert row["dense_variants"] == 24
    assert row["dense_setup_seconds"] == pytest.approx(12 * (6.7 + 13.6))
    assert row["dense_setup_seconds"] == pytest.approx(245, abs=2)
    assert row["dense_arena_bytes"] == 24 * 4096 * 8192 * 2
    assert row["setup_sources"] == ["recorded"]
    assert not row["dense_setup_extrapolated"] and not row["stateful_setup_extrapolated"]
    # the stateful function's arena (24 x 4,096 x 8,192) is h4096's: priced at its recorded 13.6 s per layer
    assert row["stateful_setup_seconds"] == pytest.approx(12 * 13.6)
    # below the recorded arenas (chunk 2,048: 24 x 2,048 x 2,048 x 2 = 0.2 GB at h0) the fit extrapolates
    assert chunk_sweep(g, 4333, (2048,), data_dir=DATA)[0]["dense_setup_extrapolated"]
    # negative control: one chunk more (a prompt past 8,192) visits h8192 too — 37.5 s more per layer
    longer = chunk_sweep(g, 8193, (4096,), data_dir=DATA)[0]
    assert longer["dense_setup_seconds"] == pytest.approx(12 * (6.7 + 13.6 + 37.5))


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(prompt_tokens=0), "prompt-tokens"),
        (dict(chunks=()), "at least one chunk"),
        (dict(chunks=(4, 0)), "positive integers"),
        (dict(chunks=(4, 4)), "one twice"),
        (dict(key_tile=3), "does not divide the chunk 4"),
        (dict(key_tile=0), "--tile"),
        (dict(load_floor_seconds=-1.0), "load floor"),
        (dict(load_floor_seconds="0.1"), "load floor"),
    ],
)
def test_bad_input_is_refused_with_one_line(args, match):
    kwargs = dict(prompt_tokens=PROMPT, chunks=(4, 8), key_tile=2) | args
    with pytest.raises(AnelabInputError, match=match) as e:
        chunk_sweep(TINY, **kwargs)
    assert "\n" not in str(e.value)


def test_seed_utilization_claim_is_labelled_as_not_measured():
    text = seed_utilization_table()
    assert text.splitlines()[0] == "[claim from flash-attention-on-ane.txt, not measured]"
    assert [row[0] for row in SEED_UTILIZATION_CLAIM] == [64, 128, 256, 512, 1024]


# ---- measured path: saved packages ------------------------------------------------------------------
CHUNK, P_MEASURED, KEY_TILE = 8, 20, 4  # 3 calls (the last one 4 real rows), histories 0, 8, 16


@pytest.fixture(scope="module")
def designs(tiny_checkpoint, tmp_path_factory):
    ckpt = tiny_checkpoint("llama")
    out = tmp_path_factory.mktemp("designs")
    return ckpt, export_designs(ckpt, out, layer=0, chunk=CHUNK, prompt_tokens=P_MEASURED, key_tile=KEY_TILE)


def test_designs_cover_the_prompt_with_the_expected_functions(designs):
    _, exports = designs
    assert exports["dense"].functions == ["h0", "h8", "h16"]
    assert exports["tiled"].functions == ["h0", "h8", "h16"]
    assert exports["stateful"].functions == ["c8"]


def test_ends_only_keeps_the_first_and_the_longest_history_at_the_same_coverage(tiny_checkpoint, tmp_path, designs):
    """The compressed designs of notebook 05: dense / tiled carry h0 and the last chunk's function only,
    over the same coverage as the full package (so the same positions); stateful is unchanged. The
    int8 dense package still verifies from disk (both functions, with its compression comparison)."""
    from anelab.sidecar.checks.verify import verify_package

    ckpt, full = designs
    ends = export_designs(
        ckpt,
        tmp_path,
        layer=0,
        chunk=CHUNK,
        prompt_tokens=P_MEASURED,
        key_tile=KEY_TILE,
        weights_mode="int8",
        ends_only=True,
    )
    assert ends["dense"].functions == ["h0", "h16"] and ends["tiled"].functions == ["h0", "h16"]
    assert ends["stateful"].functions == full["stateful"].functions == ["c8"]
    # negative control: the full export of the same prompt carries the middle function too
    assert "h8" in full["dense"].functions and "h8" not in ends["dense"].functions
    for design in ("dense", "tiled"):
        assert ends[design].metadata.coverage == full[design].metadata.coverage == 24
        assert ends[design].package.parent.name == f"{design}-int8-ends"  # beside, not over, a full export
    report = verify_package(ends["dense"].package, load_checkpoint(ckpt))
    assert report.passed and not report.vacuous
    assert {c.function for c in report.comparisons} == {"h0", "h16"}
    assert any(c.cost for c in report.comparisons)  # the int8-vs-uncompressed-weights comparison ran


def test_export_grid_in_two_processes_gives_the_same_packages(tiny_checkpoint, tmp_path, capfd):
    """The grid of notebook 05 §4 exported by two worker processes: every (chunk, design) package is
    there, with the functions the prompt needs, and computes what the in-process export computes.
    The workers draw no progress bars of their own (in a notebook they would land in its output)."""
    ckpt = tiny_checkpoint("llama")
    chunks, designs = [8, 16], ("dense", "stateful")
    grid = dict(layer=0, prompt_tokens=P_MEASURED, chunks=chunks, designs=designs, key_tile=KEY_TILE)
    capfd.readouterr()
    pooled = export_design_grid(ckpt, tmp_path / "pool", workers=2, **grid)
    assert "export functions" not in capfd.readouterr().err
    local = export_design_grid(ckpt, tmp_path / "local", workers=1, **grid)
    assert "export functions" in capfd.readouterr().err  # negative control: in-process exports show theirs
    assert pooled[8]["dense"].functions == ["h0", "h8", "h16"] and pooled[16]["dense"].functions == ["h0", "h16"]
    assert pooled[8]["stateful"].functions == ["c8"]
    hidden = np.random.default_rng(5).standard_normal((P_MEASURED, 64)).astype(np.float16)
    for C in chunks:
        for design in designs:
            assert pooled[C][design].package.is_relative_to(tmp_path / "pool" / f"chunk{C}")
            assert np.array_equal(
                prefill_prompt(pooled[C][design].package, hidden), prefill_prompt(local[C][design].package, hidden)
            )
    # negative control: a package of another chunk width computes something else on this prompt's last chunk
    other = prefill_prompt(pooled[16]["dense"].package, hidden)
    assert not np.array_equal(other, prefill_prompt(pooled[8]["dense"].package, hidden))
    with pytest.raises(AnelabInputError, match="export workers"):
        export_design_grid(ckpt, tmp_path / "bad", workers=0, **grid)


def test_largest_intermediate_from_disk(designs):
    """tiny llama: Hq 4, Hkv 2, d 16, D 64. Dense h16 scores [Hkv, G*C, H + C] = 2 x 16 x 24 fp16 =
    1,536 B (the q projection output is 8 x 64 x 2 = 1,024 B). Tiled with key tile 4: the score
    tile is 4 x 8 x 4 x 2 = 256 B, so its largest tensor is no score tensor and stays below 1,536."""
    _, exports = designs
    dense = package_facts(exports["dense"].package)
    tiled = package_facts(exports["tiled"].package)
    stateful = package_facts(exports["stateful"].package)
    assert dense["largest_intermediate_bytes"]["h16"] == 4 * 8 * 24 * 2
    assert dense["largest_intermediate_bytes"]["h0"] == 1024  # q_proj [8, 64]: h0 scores are 4*8*8*2 = 512
    assert max(tiled["largest_intermediate_bytes"].values()) < 4 * 8 * 24 * 2
    assert stateful["largest_intermediate_bytes"]["c8"] == 4 * 8 * 24 * 2  # scores every one of 24 slots
    assert dense["weight_bytes"] > 0 and dense["total_bytes"] > dense["weight_bytes"]


@pytest.mark.parametrize("design", DESIGNS)
def test_whole_prompt_through_each_saved_design_matches_the_reference(designs, design):
    ckpt, exports = designs
    rng = np.random.default_rng(3)
    hidden = rng.standard_normal((P_MEASURED, 64)).astype(np.float16)
    expected = prompt_reference(hidden, load_checkpoint(ckpt).layer(0), load_checkpoint(ckpt).geometry).attn_out
    out = prefill_prompt(exports[design].package, hidden)
    assert out.shape == (P_MEASURED, 64)
    err = np.linalg.norm(out.astype(np.float64) - expected) / np.linalg.norm(expected)
    assert err < FP16_THRESHOLD
    # negative control: change only the first chunk's rows; the last chunk's outputs depend on them
    # through the carried K/V history, so they must move away from the original reference
    other = hidden.copy()
    other[:CHUNK] = rng.standard_normal((CHUNK, 64)).astype(np.float16)
    moved = prefill_prompt(exports[design].package, other)[2 * CHUNK :]
    tail = expected[2 * CHUNK :]
    assert np.linalg.norm(moved.astype(np.float64) - tail) / np.linalg.norm(tail) > 10 * FP16_THRESHOLD


def test_prefill_refuses_a_prompt_past_the_exported_functions(designs):
    _, exports = designs
    hidden = np.zeros((3 * CHUNK + 1, 64), np.float16)
    for design in DESIGNS:
        with pytest.raises(AnelabInputError):
            prefill_prompt(exports[design].package, hidden)


def test_numpy_prefill_record_is_written_as_measured(designs, tmp_path):
    ckpt, exports = designs
    hidden = np.random.default_rng(4).standard_normal((P_MEASURED, 64)).astype(np.float16)
    expected = prompt_reference(hidden, load_checkpoint(ckpt).layer(0), load_checkpoint(ckpt).geometry).attn_out
    ticks = iter(range(100))
    timing = time_numpy_prefill(
        exports["stateful"].package, hidden, expected, repeats=2, clock=lambda: float(next(ticks))
    )
    assert (timing.design, timing.chunk, timing.calls) == ("stateful", CHUNK, 3)
    assert timing.stats.samples == (1.0, 1.0) and timing.attn_out_error < FP16_THRESHOLD
    record = numpy_prefill_record([timing], checkpoint="tiny", layer=0, key_tile=KEY_TILE, out_dir=tmp_path)
    back = read_record(tmp_path / record["_file"])
    assert back["origin"] == "measured" and back["kind"] == "numpy_prefill_timing"
    assert "not the ANE" in back["parameters"]["evaluator"]
    assert back["results"]["rows"][0]["median_s"] == 1.0
