"""Gather-graph sizing against the ANE prefill research seed, and the crossover formula by brute force."""

import json

import pytest

from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.studies.gather_sizing import GatherSizing, crossover_budget, crossover_total, size, sizing_table

# "The gather graph: sized, rejected" (ANE prefill research seed): Qwen 3.8-like geometry
SEED = dict(heads=24, head_dim=256, chunk=4096, total=8192, budget=2051)
SEED_DENSE_GB, SEED_GATHER_GB, SEED_RATIO = 1.6, 103, 64  # as printed: one decimal, integer, integer
SEED_PROBE_CHUNK_GB = 1.6  # "stops running ... once the gathered keys reach 1.6 GB" at chunk 64
GB, GIB = 10**9, 2**30


def test_seed_figures_reproduce_in_decimal_gigabytes():
    s = GatherSizing(**SEED)
    assert round(s.dense_score_bytes / GB, 1) == SEED_DENSE_GB
    assert round(s.gather_key_bytes / GB) == SEED_GATHER_GB
    assert round(s.ratio) == SEED_RATIO
    # the seed's unit is 1e9 bytes: in GiB the same counts read 1.5 and 96, not the printed figures
    assert round(s.dense_score_bytes / GIB, 1) != SEED_DENSE_GB
    assert round(s.gather_key_bytes / GIB) != SEED_GATHER_GB


def test_seed_probe_chunk_reaches_1_6_gb_of_gathered_keys():
    # the probe ran at chunk 32 and failed at chunk 64; at 64 the gathered keys are ~1.6 GB
    assert round(GatherSizing(**(SEED | dict(chunk=64))).gather_key_bytes / GB, 1) == SEED_PROBE_CHUNK_GB
    assert round(GatherSizing(**(SEED | dict(chunk=32))).gather_key_bytes / GB, 1) == 0.8


def test_bytes_by_hand():
    s = GatherSizing(heads=2, head_dim=4, chunk=3, total=5, budget=2)
    assert s.dense_score_bytes == 2 * 3 * 5 * 2 == 60
    assert s.gather_key_bytes == s.gather_value_bytes == 2 * 3 * 2 * 4 * 2 == 96
    assert s.gather_score_bytes == 2 * 3 * 2 * 2 == 24
    assert s.ratio == 96 / 60
    assert s.gather_key_shape == (2, 3, 2, 4) and s.dense_score_shape == (2, 3, 5)


def test_kv_heads_gathers_once_per_group():
    per_query_head = GatherSizing(**SEED)
    per_kv_head = GatherSizing(**SEED, kv_heads=4)
    assert per_kv_head.gather_key_bytes * 6 == per_query_head.gather_key_bytes
    assert per_kv_head.dense_score_bytes == per_query_head.dense_score_bytes


def test_size_dict_has_the_documented_keys():
    d = size(**SEED)
    for key in ("dense_score_bytes", "gather_key_bytes", "gather_value_bytes", "ratio", "crossover_budget"):
        assert key in d
    assert d["gather_keys_smaller"] is False
    assert json.loads(json.dumps(d)) == d  # plain JSON types


# ---- crossover: closed form vs brute force --------------------------------------------------------
def brute_crossover_budget(heads, gather_heads, head_dim, total, factor):
    """Largest budget whose gathered bytes are strictly below the dense scores (chunk, dtype cancel)."""
    best = 0
    for budget in range(1, heads * total + 2):
        if factor * gather_heads * budget * head_dim < heads * total:
            best = budget
    return best


def brute_crossover_total(heads, gather_heads, head_dim, budget, factor):
    total = 1
    while not factor * gather_heads * budget * head_dim < heads * total:
        total += 1
    return total


GRID = [
    (heads, kv, head_dim, total)
    for heads in (1, 2, 6)
    for kv in (None, 1, 2)
    if kv is None or heads % kv == 0
    for head_dim in (1, 2, 3, 8)
    for total in (1, 2, 5, 8, 16, 17, 33)
]


@pytest.mark.parametrize("include_values", [False, True])
def test_crossover_budget_matches_brute_force(include_values):
    factor = 2 if include_values else 1
    for heads, kv, head_dim, total in GRID:
        expected = brute_crossover_budget(heads, kv or heads, head_dim, total, factor)
        got = crossover_budget(heads, head_dim, total, kv_heads=kv, include_values=include_values)
        assert got == expected, (heads, kv, head_dim, total)


def test_crossover_total_matches_brute_force():
    for heads, kv, head_dim, _ in GRID:
        for budget in (1, 2, 3, 7):
            for include_values in (False, True):
                expected = brute_crossover_total(heads, kv or heads, head_dim, budget, 2 if include_values else 1)
                got = crossover_total(heads, head_dim, budget, kv_heads=kv, include_values=include_values)
                assert got == expected


def test_naive_crossover_formula_is_caught_by_the_grid():
    # negative control: total // head_dim is off by one whenever head_dim divides total
    mismatches = [
        (heads, head_dim, total)
        for heads, kv, head_dim, total in GRID
        if kv is None and total // head_dim != brute_crossover_budget(heads, heads, head_dim, total, 1)
    ]
    assert mismatches


def test_crossover_agrees_with_the_sizing_at_the_edge():
    edge = crossover_budget(24, 256, 8192)
    assert edge == 31  # 31 * 256 = 7,936 < 8,192 <= 32 * 256
    assert GatherSizing(24, 256, 4096, 8192, edge).gather_keys_smaller
    assert not GatherSizing(24, 256, 4096, 8192, edge + 1).gather_keys_smaller
    assert crossover_total(24, 256, 2051) == 2051 * 256 + 1


# ---- refusals and the table -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "change,fragment",
    [
        (dict(heads=0), "heads"),
        (dict(head_dim=-1), "head_dim"),
        (dict(chunk=0), "chunk"),
        (dict(budget=0), "budget"),
        (dict(budget=8193), "budget"),
        (dict(total=2048), "total"),  # below the chunk
        (dict(kv_heads=5), "multiple"),
        (dict(chunk=4096.0), "integer"),
    ],
)
def test_sizing_refuses_bad_geometry(change, fragment):
    with pytest.raises(AnelabInputError, match=fragment):
        GatherSizing(**(SEED | change))


def test_sizing_table_rows_and_clipping():
    rows = sizing_table([32, 64], [8, 2051], heads=24, head_dim=256, history=0)
    assert [(r["chunk"], r["budget_requested"]) for r in rows] == [(32, 8), (32, 2051), (64, 8), (64, 2051)]
    assert rows[1]["budget"] == 32 and rows[1]["budget_clipped"]  # a row sees only 32 keys
    assert not rows[0]["budget_clipped"]
    fixed = sizing_table([4096], [2051], heads=24, head_dim=256, total=8192)
    assert fixed[0]["gather_key_bytes"] == GatherSizing(**SEED).gather_key_bytes
    with pytest.raises(AnelabInputError, match="exactly one"):
        sizing_table([32], [8], heads=24, head_dim=256)


# ---- CLI ------------------------------------------------------------------------------------------
SEED_ARGS = ["size", "--heads", "24", "--head-dim", "256", "--chunk", "4096", "--total", "8192", "--budget", "2051"]


def test_cli_size_json(capsys):
    assert main(SEED_ARGS + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["dense_score_bytes"] == 24 * 4096 * 8192 * 2
    assert d["gather_key_bytes"] == 24 * 4096 * 2051 * 256 * 2
    assert round(d["ratio"]) == SEED_RATIO


def test_cli_size_table(capsys):
    assert main(SEED_ARGS) == 0
    out = capsys.readouterr().out
    assert "1.61" in out and "103.23" in out and "64.09x" in out


@pytest.mark.parametrize("flag,value", [("--heads", "0"), ("--budget", "-3"), ("--chunk", "0")])
def test_cli_size_refuses_nonpositive(capsys, flag, value):
    args = list(SEED_ARGS)
    args[args.index(flag) + 1] = value
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("anelab: error:") and "\n" not in err and "positive" in err


def test_dense_scores_are_the_geometry_score_arena():
    # same tensor, two modules: the seed's 3.2 GB h12288 arena (24 heads, chunk 4096, total 16384)
    from anelab.core.geometry import AttentionGeometry

    geometry = AttentionGeometry("qwen3_next", hidden_size=2048, num_heads=24, num_kv_heads=4, head_dim=256)
    s = GatherSizing(24, 256, 4096, 12288 + 4096, 2051)
    assert s.dense_score_bytes == geometry.score_arena_bytes(4096, 12288)
    assert round(s.dense_score_bytes / GB, 1) == 3.2
