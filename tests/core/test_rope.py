"""RoPE frequency tables for every transformers RoPE type, checked against hand-derived values.

Expected values never come from anelab.core.rope: they are literal numbers worked out by hand for
theta 10000 / rotary_dim 8 (where 10000 ** (i / 8) is 1, 10, 100, 1000), or scalar loops written out
from the formulas in transformers' modeling_rope_utils.py (5.16.0.dev0). Every type also has a negative
control: a wrong parameter gives a table that fails the same comparison.
"""

import math

import numpy as np
import pytest

from anelab.core.errors import AnelabInputError
from anelab.core.rope import (
    ROPE_TYPES,
    RopeScaling,
    half_to_interleaved,
    interleaved_to_half,
    rope_cos_sin,
    rope_frequencies,
)

THETA, DIM = 10000.0, 8
DEFAULT_INV = [1.0, 0.1, 0.01, 0.001]  # 1 / 10000 ** (i / 8), i = 0, 2, 4, 6
RTOL = 1e-12


def close(actual, expected, rtol=RTOL):
    return np.allclose(np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64), rtol=rtol, atol=0)


def freqs(scaling, *, coverage=16, mpe=None, theta=THETA, dim=DIM):
    return rope_frequencies(theta, dim, scaling, coverage=coverage, max_position_embeddings=mpe)


# ---- scalar re-derivations (loops, math module only) -------------------------------------------


def scalar_default(theta, dim):
    return [1.0 / theta ** (i / dim) for i in range(0, dim, 2)]


def scalar_llama3(theta, dim, factor, low_ff, high_ff, old_ctx):
    out = []
    for f in scalar_default(theta, dim):
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high_ff:
            out.append(f)
        elif wavelen > old_ctx / low_ff:
            out.append(f / factor)
        else:
            s = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
            out.append((1 - s) * f / factor + s * f)
    return out


def scalar_yarn(theta, dim, factor, orig, beta_fast=32, beta_slow=1, truncate=True):
    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr(beta_fast), corr(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for k, i in enumerate(range(0, dim, 2)):
        ramp = min(max((k - low) / (high - low), 0.0), 1.0)
        extra = 1.0 / theta ** (i / dim)
        inter = 1.0 / (factor * theta ** (i / dim))
        out.append(inter * ramp + extra * (1 - ramp))
    return out


# ---- default / linear --------------------------------------------------------------------------


def test_default_is_the_plain_table():
    inv, af = freqs(RopeScaling())
    assert inv.dtype == np.float64 and inv.shape == (4,)
    assert close(inv, DEFAULT_INV) and af == 1.0


def test_default_wide_head_matches_scalar_loop():
    inv, _ = freqs(RopeScaling(), theta=1_000_000.0, dim=128)
    assert close(inv, scalar_default(1_000_000.0, 128))


def test_linear_factor_4_divides_inv_freq():
    inv, af = freqs(RopeScaling(rope_type="linear", factor=4.0))
    assert close(inv, [0.25, 0.025, 0.0025, 0.00025]) and af == 1.0
    wrong, _ = freqs(RopeScaling(rope_type="linear", factor=2.0))
    assert not close(wrong, [0.25, 0.025, 0.0025, 0.00025], rtol=1e-3)


# ---- dynamic NTK -------------------------------------------------------------------------------


@pytest.mark.parametrize("coverage", [1, 8, 16])
def test_dynamic_at_or_below_max_positions_is_default(coverage):
    inv, af = freqs(RopeScaling(rope_type="dynamic", factor=2.0), coverage=coverage, mpe=16)
    assert close(inv, DEFAULT_INV) and af == 1.0


@pytest.mark.parametrize("coverage, bracket", [(24, 2.0), (32, 3.0)])
def test_dynamic_above_max_positions_raises_base(coverage, bracket):
    # base' = theta * (factor * s / mpe - (factor - 1)) ** (d / (d - 2)); factor 2, mpe 16, d 8
    # s = 24 -> 2 * 24 / 16 - 1 = 2; s = 32 -> 3; exponent 8 / 6
    base = THETA * bracket ** (8 / 6)
    expected = [1.0 / base ** (i / 8) for i in (0, 2, 4, 6)]
    inv, af = freqs(RopeScaling(rope_type="dynamic", factor=2.0), coverage=coverage, mpe=16)
    assert close(inv, expected) and af == 1.0
    assert not close(inv, DEFAULT_INV, rtol=1e-3)
    wrong, _ = freqs(RopeScaling(rope_type="dynamic", factor=4.0), coverage=coverage, mpe=16)
    assert not close(wrong, expected, rtol=1e-3)


def test_dynamic_needs_max_position_embeddings():
    with pytest.raises(AnelabInputError, match="max_position_embeddings"):
        freqs(RopeScaling(rope_type="dynamic", factor=2.0), coverage=32, mpe=None)


# ---- llama3 ------------------------------------------------------------------------------------


def test_llama3_three_bands_by_hand():
    # old_ctx 1024, low_ff 1, high_ff 4 -> low_freq_wavelen 1024, high_freq_wavelen 256.
    # wavelen = 2 pi / inv = 6.28, 62.8 (< 256: unchanged), 628.3 (medium: smoothed), 6283 (> 1024: / factor)
    wl_mid = 2 * math.pi / 0.01
    s = (1024 / wl_mid - 1.0) / (4.0 - 1.0)
    mid = (1 - s) * 0.01 / 8.0 + s * 0.01
    expected = [1.0, 0.1, mid, 0.001 / 8.0]
    assert 0.01 / 8 < mid < 0.01 and 0 < s < 1
    scaling = RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=1024
    )
    inv, af = freqs(scaling)
    assert close(inv, expected) and af == 1.0
    wrong, _ = freqs(
        RopeScaling(
            rope_type="llama3",
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=1024,
        )
    )
    assert not close(wrong, expected, rtol=1e-3)


def test_llama31_config_matches_scalar_loop():
    cfg = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }
    scaling = RopeScaling.from_config(cfg, max_position_embeddings=131072)
    inv, af = rope_frequencies(500000.0, 128, scaling, coverage=4096, max_position_embeddings=131072)
    assert close(inv, scalar_llama3(500000.0, 128, 8.0, 1.0, 4.0, 8192)) and af == 1.0


def test_llama3_original_max_defaults_to_max_position_embeddings():
    # transformers' standardize_rope_params: setdefault(original_max_position_embeddings, max_position_embeddings)
    cfg = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling = RopeScaling.from_config(cfg, max_position_embeddings=1024)
    assert scaling.original_max_position_embeddings == 1024
    with pytest.raises(AnelabInputError, match="original_max_position_embeddings"):
        RopeScaling.from_config(cfg, max_position_embeddings=None)


# ---- yarn --------------------------------------------------------------------------------------


def yarn(**kw):
    kw.setdefault("factor", 4.0)
    kw.setdefault("original_max_position_embeddings", 64)
    return RopeScaling(rope_type="yarn", **kw)


# orig 64, theta 1e4, d 8: correction_dim(32) = 8 ln(64 / 64pi) / (2 ln 1e4) < 0 -> floor -> clamp 0;
# correction_dim(1) = 8 ln(64 / 2pi) / (2 ln 1e4) = 1.008 -> ceil 2. ramp over k = 0..3: 0, .5, 1, 1.
# inv = interp * ramp + extrap * (1 - ramp), interp = extrap / 4.
YARN_BY_HAND = [1.0, 0.5 * 0.1 + 0.5 * 0.1 / 4, 0.01 / 4, 0.001 / 4]


def test_yarn_table_by_hand():
    hi = 8 * math.log(64 / (2 * math.pi)) / (2 * math.log(THETA))
    assert 1.0 < hi < 2.0  # so ceil gives 2, as used above
    inv, af = freqs(yarn())
    assert close(inv, YARN_BY_HAND)
    assert close([af], [0.1 * math.log(4.0) + 1.0])
    wrong, _ = freqs(yarn(factor=8.0))
    assert not close(wrong, YARN_BY_HAND, rtol=1e-3)


def test_yarn_truncate_false_keeps_fractional_bounds():
    hi = 8 * math.log(64 / (2 * math.pi)) / (2 * math.log(THETA))  # low stays clamped at 0
    r1 = 1 / hi
    expected = [1.0, 0.1 / 4 * r1 + 0.1 * (1 - r1), 0.01 / 4, 0.001 / 4]
    inv, _ = freqs(yarn(truncate=False))
    assert close(inv, expected)
    assert not close(inv, YARN_BY_HAND, rtol=1e-4)
    assert close(freqs(yarn(truncate=True))[0], YARN_BY_HAND)  # absent == True


def test_yarn_wide_head_matches_scalar_loop():
    scaling = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)
    inv, _ = rope_frequencies(1_000_000.0, 128, scaling, coverage=8, max_position_embeddings=131072)
    assert close(inv, scalar_yarn(1_000_000.0, 128, 4.0, 32768))
    inv_b, _ = rope_frequencies(
        1_000_000.0,
        128,
        yarn(factor=4.0, original_max_position_embeddings=32768, beta_fast=16.0, beta_slow=2.0, truncate=False),
        coverage=8,
        max_position_embeddings=131072,
    )
    assert close(inv_b, scalar_yarn(1_000_000.0, 128, 4.0, 32768, 16.0, 2.0, truncate=False))
    assert not close(inv_b, inv, rtol=1e-4)


def test_yarn_high_bound_clamps_at_dim_minus_1_not_half():
    # transformers clamps the correction range with min(high, dim - 1) although the ramp runs over
    # dim // 2 entries. orig 1e6, d 8: correction_dim(1) = 5.2 -> ceil 6 (kept: 6 <= 7);
    # correction_dim(1000) = 2.2 -> floor 2. ramp k = 0..3: 0, 0, 0, (3 - 2) / (6 - 2) = 0.25.
    assert 5 < 8 * math.log(1e6 / (2 * math.pi)) / (2 * math.log(THETA)) < 6
    assert 2 < 8 * math.log(1e6 / (1000 * 2 * math.pi)) / (2 * math.log(THETA)) < 3
    expected = [1.0, 0.1, 0.01, 0.25 * 0.001 / 4 + 0.75 * 0.001]
    inv, _ = freqs(yarn(original_max_position_embeddings=1_000_000, beta_fast=1000.0))
    assert close(inv, expected)
    assert close(expected, scalar_yarn(THETA, DIM, 4.0, 1_000_000, beta_fast=1000.0))


def test_yarn_attention_factor_variants():
    ln4 = math.log(4.0)
    plain = 0.1 * ln4 + 1.0
    assert close([freqs(yarn(mscale=1.0, mscale_all_dim=0.5))[1]], [(0.1 * ln4 + 1) / (0.05 * ln4 + 1)])
    assert freqs(yarn(mscale=1.0, mscale_all_dim=1.0))[1] == 1.0  # DeepSeek-V3 style: ratio 1
    # transformers uses the mscale ratio only when both are truthy; either alone -> plain 0.1 ln f + 1
    assert close([freqs(yarn(mscale=0.707))[1]], [plain])
    assert close([freqs(yarn(mscale_all_dim=0.707))[1]], [plain])
    assert freqs(yarn(attention_factor=0.5))[1] == 0.5
    assert freqs(yarn(factor=1.0))[1] == 1.0  # get_mscale(scale <= 1) = 1


def test_yarn_null_factor_uses_max_over_original():
    scaling = RopeScaling.from_config(
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}, max_position_embeddings=256
    )
    inv, af = freqs(scaling, mpe=256)  # 256 / 64 = 4
    assert close(inv, YARN_BY_HAND) and close([af], [0.1 * math.log(4.0) + 1.0])


def test_yarn_zero_betas_fall_back_to_defaults():  # transformers: .get("beta_fast") or 32
    assert close(freqs(yarn(beta_fast=0.0, beta_slow=0.0))[0], YARN_BY_HAND)


def test_yarn_real_config_shapes_parse():
    gpt_oss_like = {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    }
    s = RopeScaling.from_config(gpt_oss_like, max_position_embeddings=131072)
    assert s.truncate is False and s.factor == 32.0
    deepseek_like = {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    }
    s = RopeScaling.from_config(deepseek_like, max_position_embeddings=163840)
    assert s.rope_type == "yarn" and s.mscale == 1.0
    inv, af = rope_frequencies(10000.0, 64, s, coverage=8, max_position_embeddings=163840)
    assert af == 1.0 and close(inv, scalar_yarn(10000.0, 64, 40.0, 4096))


# ---- longrope ----------------------------------------------------------------------------------

SHORT, LONG = (1.0, 1.5, 2.0, 2.5), (1.0, 4.0, 8.0, 16.0)


def longrope(**kw):
    kw.setdefault("original_max_position_embeddings", 32)
    return RopeScaling(rope_type="longrope", short_factor=SHORT, long_factor=LONG, **kw)


def test_longrope_short_vs_long_by_coverage():
    short_expected = [1.0 / 1.0, 0.1 / 1.5, 0.01 / 2.0, 0.001 / 2.5]
    long_expected = [1.0 / 1.0, 0.1 / 4.0, 0.01 / 8.0, 0.001 / 16.0]
    for coverage in (1, 32):  # <= original 32: short
        assert close(freqs(longrope(), coverage=coverage, mpe=128)[0], short_expected)
    for coverage in (33, 128):  # > original: long
        assert close(freqs(longrope(), coverage=coverage, mpe=128)[0], long_expected)
    assert not close(freqs(longrope(), coverage=33, mpe=128)[0], short_expected, rtol=1e-3)


def test_longrope_attention_factor():
    # factor absent -> 128 / 32 = 4; sqrt(1 + ln 4 / ln 32) = sqrt(1 + 2/5)
    assert close([freqs(longrope(), mpe=128)[1]], [math.sqrt(1.4)])
    assert close([freqs(longrope(factor=2.0), mpe=128)[1]], [math.sqrt(1.2)])  # explicit factor wins
    assert freqs(longrope(factor=1.0), mpe=128)[1] == 1.0
    assert freqs(longrope(attention_factor=1.3), mpe=128)[1] == 1.3
    assert not close([freqs(longrope(factor=8.0), mpe=128)[1]], [math.sqrt(1.4)], rtol=1e-3)


def test_longrope_phi3_top_level_original_wins():
    cfg = {
        "type": "longrope",
        "short_factor": list(SHORT),
        "long_factor": list(LONG),
        "original_max_position_embeddings": 64,
    }
    s = RopeScaling.from_config(cfg, max_position_embeddings=128, original_max_position_embeddings=32)
    assert s.original_max_position_embeddings == 32 and s.short_factor == SHORT
    assert close(freqs(s, coverage=33, mpe=128)[0], [1.0, 0.1 / 4, 0.01 / 8, 0.001 / 16])


def test_longrope_factor_length_must_match():
    with pytest.raises(AnelabInputError, match="entries"):
        rope_frequencies(THETA, 16, longrope(), coverage=4, max_position_embeddings=128)


# ---- cos / sin ---------------------------------------------------------------------------------


def test_cos_sin_layout_and_factor():
    positions = np.array([0, 1, 7])
    cos, sin = rope_cos_sin(positions, np.array(DEFAULT_INV), 1.25, dtype=np.float64)
    assert cos.shape == sin.shape == (3, 8)
    for t, p in enumerate([0, 1, 7]):
        for j in range(8):
            f = DEFAULT_INV[j % 4]
            assert math.isclose(cos[t, j], math.cos(p * f) * 1.25, rel_tol=1e-14, abs_tol=1e-15)
            assert math.isclose(sin[t, j], math.sin(p * f) * 1.25, rel_tol=1e-14, abs_tol=1e-15)
    cos32, _ = rope_cos_sin(positions, np.array(DEFAULT_INV), 1.25)
    assert cos32.dtype == np.float32


def test_yarn_cos_sin_carry_attention_factor():
    inv, af = freqs(yarn())
    cos, sin = rope_cos_sin(np.array([3]), inv, af, dtype=np.float64)
    m = 0.1 * math.log(4.0) + 1.0
    for j in range(8):
        assert math.isclose(cos[0, j], math.cos(3 * YARN_BY_HAND[j % 4]) * m, rel_tol=1e-12)
        assert math.isclose(sin[0, j], math.sin(3 * YARN_BY_HAND[j % 4]) * m, rel_tol=1e-12)


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3", "yarn"])
def test_coverage_ignored_where_transformers_ignores_seq_len(rope_type):
    scaling = {
        "default": RopeScaling(),
        "linear": RopeScaling(rope_type="linear", factor=4.0),
        "llama3": RopeScaling(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=1024,
        ),
        "yarn": yarn(),
    }[rope_type]
    a, fa = freqs(scaling, coverage=1, mpe=16)
    b, fb = freqs(scaling, coverage=1_000_000, mpe=16)
    assert np.array_equal(a, b) and fa == fb


# ---- interleaved (GLM) layout ------------------------------------------------------------------


def glm_rope_scalar(x, p, inv, rot):
    """transformers GLM/GLM-4: pairs (2i, 2i+1) rotate by inv[i]; channels >= rot pass through."""
    y = list(x)
    for i in range(rot // 2):
        c, s = math.cos(p * inv[i]), math.sin(p * inv[i])
        y[2 * i] = x[2 * i] * c - x[2 * i + 1] * s
        y[2 * i + 1] = x[2 * i + 1] * c + x[2 * i] * s
    return y


def half_rope_scalar(x, p, inv, rot):
    """transformers rotate_half layout: channel j pairs with j + rot/2."""
    y, h = list(x), rot // 2
    for j in range(h):
        c, s = math.cos(p * inv[j]), math.sin(p * inv[j])
        y[j] = x[j] * c - x[j + h] * s
        y[j + h] = x[j + h] * c + x[j] * s
    return y


def test_interleaved_to_half_permutation():
    x = np.arange(6.0)
    assert interleaved_to_half(x, 4).tolist() == [0.0, 2.0, 1.0, 3.0, 4.0, 5.0]
    assert half_to_interleaved(interleaved_to_half(x, 4), 4).tolist() == x.tolist()


def test_interleaved_rope_equals_half_rope_after_reordering():
    rng = np.random.default_rng(0)
    rot, head, inv, p = 8, 12, DEFAULT_INV, 5
    q, k = rng.standard_normal(head), rng.standard_normal(head)
    lhs = half_rope_scalar(interleaved_to_half(q, rot).tolist(), p, inv, rot)
    rhs = interleaved_to_half(np.array(glm_rope_scalar(q.tolist(), p, inv, rot)), rot)
    assert np.allclose(lhs, rhs, rtol=0, atol=1e-12)
    # q.k after RoPE is the same in both layouts (positions 5 and 2)
    glm_dot = np.dot(glm_rope_scalar(q.tolist(), 5, inv, rot), glm_rope_scalar(k.tolist(), 2, inv, rot))
    half_dot = np.dot(
        half_rope_scalar(interleaved_to_half(q, rot).tolist(), 5, inv, rot),
        half_rope_scalar(interleaved_to_half(k, rot).tolist(), 2, inv, rot),
    )
    assert math.isclose(glm_dot, half_dot, rel_tol=1e-12)
    # negative control: skipping the reorder breaks the equality
    wrong = half_rope_scalar(q.tolist(), p, inv, rot)
    assert not np.allclose(wrong, glm_rope_scalar(q.tolist(), p, inv, rot), atol=1e-6)


# ---- from_config: accepted shapes --------------------------------------------------------------


@pytest.mark.parametrize("cfg", [None, {}, {"rope_type": "default"}, {"type": "default", "rope_theta": 10000.0}])
def test_from_config_default(cfg):
    s = RopeScaling.from_config(cfg, max_position_embeddings=4096)
    assert s.rope_type == "default" and s.factor is None


def test_from_config_legacy_type_and_v5_keys():
    s = RopeScaling.from_config({"type": "linear", "factor": 8}, max_position_embeddings=None)
    assert s.rope_type == "linear" and s.factor == 8.0
    s = RopeScaling.from_config(
        {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}, max_position_embeddings=None
    )
    assert s.rope_theta == 1e6 and s.partial_rotary_factor == 0.5
    assert close(rope_frequencies(1e6, 8, s, coverage=1, max_position_embeddings=None)[0], scalar_default(1e6, 8))


def test_rope_types_constant():
    assert ROPE_TYPES == ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, needle",
    [
        ({"rope_type": "su", "short_factor": [1.0], "long_factor": [1.0]}, "unsupported rope_type"),
        ({"rope_type": "proportional"}, "unsupported rope_type"),
        ({"rope_type": "mrope", "mrope_section": [16, 24, 24]}, "unsupported rope_type"),
        ({"rope_type": "linear"}, "needs key"),
        ({"rope_type": "dynamic"}, "needs key"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "needs key"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "needs key"),
        ({"rope_type": "longrope", "short_factor": [1.0]}, "needs key"),
        ({"rope_type": "linear", "factor": None}, "null"),
        ({"rope_type": "default", "factor": 2.0}, "does not use"),
        ({"rope_type": "linear", "factor": 2.0, "foo": 1}, "does not use"),
        ({"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}, "does not use"),
        ({"rope_type": "default", "mrope_section": [16, 24, 24]}, "does not use"),
        ({"rope_type": "linear", "type": "dynamic", "factor": 2.0}, "keep one"),
        ({"rope_type": "linear", "factor": True}, "finite number"),
        ({"rope_type": "linear", "factor": "2"}, "finite number"),
        ({"rope_type": "linear", "factor": -2.0}, "> 0"),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, "true or false"),
        ({"rope_type": "longrope", "short_factor": [], "long_factor": [1.0]}, "non-empty list"),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8.5,
            },
            "positive integer",
        ),
        ({"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}, "nested"),
    ],
)
def test_from_config_refuses(cfg, needle):
    with pytest.raises(AnelabInputError, match=needle) as info:
        RopeScaling.from_config(cfg, max_position_embeddings=4096)
    assert "\n" not in str(info.value)


def test_direct_construction_refuses_mismatched_fields():
    with pytest.raises(AnelabInputError, match="unsupported rope_type"):
        RopeScaling(rope_type="ntk")
    with pytest.raises(AnelabInputError, match="does not apply"):
        RopeScaling(rope_type="default", factor=2.0)
    with pytest.raises(AnelabInputError, match="needs 'factor'"):
        RopeScaling(rope_type="linear")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"theta": 500000.0, "scaling": RopeScaling(rope_theta=10000.0)}, "disagrees"),
        ({"rotary_dim": 7}, "even"),
        ({"rotary_dim": 0}, "even"),
        ({"coverage": 0}, "coverage"),
        ({"theta": -1.0}, "theta"),
        (
            {
                "scaling": RopeScaling(
                    rope_type="llama3",
                    factor=8.0,
                    low_freq_factor=4.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=1024,
                )
            },
            "high_freq_factor",
        ),
        (
            {"scaling": RopeScaling(rope_type="yarn", factor=None, original_max_position_embeddings=64)},
            "max_position_embeddings",
        ),
    ],
)
def test_rope_frequencies_refuses(kwargs, needle):
    args = {"theta": THETA, "rotary_dim": DIM, "scaling": RopeScaling(), "coverage": 4} | kwargs
    with pytest.raises(AnelabInputError, match=needle):
        rope_frequencies(
            args["theta"], args["rotary_dim"], args["scaling"], coverage=args["coverage"], max_position_embeddings=None
        )
