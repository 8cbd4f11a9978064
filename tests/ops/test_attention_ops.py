"""Rotary embeddings (transformers' rotate_half, diffusers' adjacent pairs) and scaled dot-product attention
(causal, padding, sliding window, grouped-query, additive masks) against the reference libraries."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb, get_1d_rotary_pos_embed
from ml_dtypes import bfloat16
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from luminal_recipes import ops
from luminal_recipes.ops import rope_tables

NP = {"f32": np.float32, "f16": np.float16, "bf16": bfloat16}


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a).astype(np.float64))


# ---- rotary embeddings -------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["half", "pairs"])
def test_rope_tables_match_diffusers(style):
    pos = np.array([0, 1, 2, 5, 17, 100])
    cos, sin = rope_tables(pos, 16, theta=10000.0, style=style)
    ref_cos, ref_sin = get_1d_rotary_pos_embed(
        16,
        pos,
        theta=10000.0,
        use_real=True,
        repeat_interleave_real=style == "pairs",
        freqs_dtype=torch.float64,
    )
    np.testing.assert_allclose(cos, ref_cos.numpy(), rtol=0, atol=1e-7)
    np.testing.assert_allclose(sin, ref_sin.numpy(), rtol=0, atol=1e-7)


def test_rope_tables_match_transformers_llama():
    config = LlamaConfig(hidden_size=32, num_attention_heads=2, head_dim=16, rope_theta=500.0)
    ref_cos, ref_sin = LlamaRotaryEmbedding(config=config)(torch.zeros(1, 7, 16), torch.arange(7)[None])
    cos, sin = rope_tables(np.arange(7), 16, theta=500.0, style="half")
    np.testing.assert_allclose(cos, ref_cos[0].numpy(), rtol=0, atol=2e-6)
    np.testing.assert_allclose(sin, ref_sin[0].numpy(), rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize(("s", "d"), [(1, 2), (7, 16), (3, 8)])
def test_rope_split_half_matches_transformers(s, d, dtype, run_op, assert_close, rng):
    q = rng.standard_normal((2, 3, s, d)).astype(NP[dtype])
    cos, sin = rope_tables(np.arange(s) + 3, d, style="half")
    got = run_op(lambda x, c, sn: ops.apply_rope(x, c, sn, style="half"), q, cos, sin)
    want, _ = apply_rotary_pos_emb(_t(q), _t(q), _t(cos)[None], _t(sin)[None], unsqueeze_dim=1)
    assert_close("rope", got, want, dtype)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize(("s", "d"), [(1, 2), (7, 16), (3, 8)])
def test_rope_pairs_matches_diffusers(s, d, dtype, run_op, assert_close, rng):
    q = rng.standard_normal((2, 3, s, d)).astype(NP[dtype])
    cos, sin = rope_tables(np.arange(s) * 2, d, style="pairs")
    got = run_op(lambda x, c, sn: ops.apply_rope(x, c, sn, style="pairs"), q, cos, sin)
    want = apply_rotary_emb(_t(q), (_t(cos), _t(sin)), use_real=True, use_real_unbind_dim=-1)
    assert_close("rope", got, want, dtype)


def test_rope_on_a_head_split_view(run_op, assert_close, rng):
    """q arrives as [B, S, H*D] and is viewed as [B, H, S, D], as a model's projection output is."""
    b, s, h, d = 2, 5, 3, 8
    x = rng.standard_normal((b, s, h * d)).astype(np.float32)
    cos, sin = rope_tables(np.arange(s), d, style="pairs")
    got = run_op(
        lambda t, c, sn: ops.apply_rope(t.split_dim(-1, (h, d)).permute(0, 2, 1, 3), c, sn, "pairs"),
        x,
        cos,
        sin,
    )
    want = apply_rotary_emb(
        _t(x).reshape(b, s, h, d).permute(0, 2, 1, 3),
        (_t(cos), _t(sin)),
        use_real=True,
        use_real_unbind_dim=-1,
    )
    assert_close("rope", got, want)


# ---- attention ---------------------------------------------------------------------------------------------
def _qkv(rng, b=2, h=4, hkv=4, s=5, t=5, d=8, dv=None, dtype="f32"):
    q = rng.standard_normal((b, h, s, d)).astype(NP[dtype])
    k = rng.standard_normal((b, hkv, t, d)).astype(NP[dtype])
    v = rng.standard_normal((b, hkv, t, dv or d)).astype(NP[dtype])
    return q, k, v


def _allowed(s, t, causal=False, window=None, key_mask=None):
    """Explicit boolean mask [B|1, 1, S, T]; queries are the last S of T positions (bottom-right aligned)."""
    q_pos = torch.arange(s)[:, None] + (t - s)
    k_pos = torch.arange(t)[None, :]
    allowed = torch.ones(s, t, dtype=torch.bool)
    if causal:
        allowed &= k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & torch.from_numpy(key_mask)[:, None, None, :]
    return allowed


def _sdpa(q, k, v, mask=None, scale=None, gqa=False):
    return F.scaled_dot_product_attention(_t(q), _t(k), _t(v), attn_mask=mask, scale=scale, enable_gqa=gqa)


@pytest.mark.parametrize(("s", "t"), [(1, 1), (5, 5), (3, 7), (1, 7)])
def test_sdpa_unmasked_and_causal(s, t, run_op, assert_close, rng):
    q, k, v = _qkv(rng, s=s, t=t)
    assert_close("attention", run_op(ops.scaled_dot_product_attention, q, k, v), _sdpa(q, k, v))
    got = run_op(lambda a, b_, c: ops.scaled_dot_product_attention(a, b_, c, causal=True), q, k, v)
    assert_close("attention", got, _sdpa(q, k, v, _allowed(s, t, causal=True)))
    if s == t:  # torch's own causal flag is top-left aligned: the same when S == T
        want = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), is_causal=True)
        assert_close("attention", got, want)


def test_sdpa_padding_key_mask(run_op, assert_close, rng):
    q, k, v = _qkv(rng, s=5, t=7)
    key_mask = np.array([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]], dtype=bool)
    got = run_op(
        lambda a, b_, c, m: ops.scaled_dot_product_attention(a, b_, c, key_mask=m), q, k, v, key_mask
    )
    assert_close("attention", got, _sdpa(q, k, v, _allowed(5, 7, key_mask=key_mask)))
    got = run_op(
        lambda a, b_, c, m: ops.scaled_dot_product_attention(a, b_, c, causal=True, key_mask=m),
        q,
        k,
        v,
        key_mask.astype(np.int32),
    )  # an integer 0/1 mask as tokenizers give it
    assert_close("attention", got, _sdpa(q, k, v, _allowed(5, 7, causal=True, key_mask=key_mask)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [1, 2, 4])
def test_sdpa_sliding_window(window, causal, run_op, assert_close, rng):
    q, k, v = _qkv(rng, s=6, t=9)
    got = run_op(
        lambda a, b_, c: ops.scaled_dot_product_attention(a, b_, c, causal=causal, window=window), q, k, v
    )
    assert_close("attention", got, _sdpa(q, k, v, _allowed(6, 9, causal=causal, window=window)))


@pytest.mark.parametrize("hkv", [1, 2])
def test_sdpa_grouped_query(hkv, run_op, assert_close, rng):
    q, k, v = _qkv(rng, h=4, hkv=hkv, s=3, t=5, dv=6)
    got = run_op(lambda a, b_, c: ops.scaled_dot_product_attention(a, b_, c, causal=True), q, k, v)
    assert_close("attention", got, _sdpa(q, k, v, _allowed(3, 5, causal=True), gqa=True))
    # (no query may lose every key: torch returns 0 for such rows, a finite mask bias returns the mean of v)
    key_mask = np.array([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=bool)
    got = run_op(
        lambda a, b_, c, m: ops.scaled_dot_product_attention(a, b_, c, window=2, key_mask=m),
        q,
        k,
        v,
        key_mask,
    )
    assert_close("attention", got, _sdpa(q, k, v, _allowed(3, 5, window=2, key_mask=key_mask), gqa=True))


@pytest.mark.parametrize("mask_shape", [(2, 1, 3, 5), (1, 4, 3, 5), (2, 4, 3, 5)])
@pytest.mark.parametrize("hkv", [4, 2])
def test_sdpa_additive_float_mask(mask_shape, hkv, run_op, assert_close, rng):
    q, k, v = _qkv(rng, hkv=hkv, s=3, t=5)
    bias = (rng.standard_normal(mask_shape) * 2).astype(np.float32)
    got = run_op(
        lambda a, b_, c, m: ops.scaled_dot_product_attention(a, b_, c, mask=m, scale=0.3), q, k, v, bias
    )
    assert_close("attention", got, _sdpa(q, k, v, _t(bias), scale=0.3, gqa=hkv != 4))


def test_sdpa_boolean_mask_combined_with_causal(run_op, assert_close, rng):
    q, k, v = _qkv(rng, s=4, t=4)
    mask = rng.random((2, 4, 4, 4)) < 0.7
    mask[..., 0] = True  # every query keeps key 0 (also allowed by the causal mask)
    got = run_op(
        lambda a, b_, c, m: ops.scaled_dot_product_attention(a, b_, c, mask=m, causal=True), q, k, v, mask
    )
    assert_close("attention", got, _sdpa(q, k, v, _allowed(4, 4, causal=True) & torch.from_numpy(mask)))


def test_sdpa_on_projection_views(run_op, assert_close, rng):
    """q, k, v sliced out of one packed [B, S, 3*H*D] projection and permuted to [B, H, S, D]."""
    b, s, h, d = 2, 5, 2, 4
    qkv = rng.standard_normal((b, s, 3 * h * d)).astype(np.float32)

    def build(x):
        q, k, v = (p.split_dim(-1, (h, d)).permute(0, 2, 1, 3) for p in ops.chunk(x, 3, -1))
        return ops.scaled_dot_product_attention(q, k, v, causal=True)

    tq, tk, tv = (p.reshape(b, s, h, d).permute(0, 2, 1, 3) for p in torch.chunk(_t(qkv), 3, -1))
    want = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    assert_close("attention", run_op(build, qkv), want)


@pytest.mark.parametrize("s", [1, 3, 17])
def test_sdpa_symbolic_sequence(s, run_op, assert_close, rng, symbolic_input):
    q, k, v = _qkv(rng, h=2, hkv=1, s=s, t=s)
    shape = (2, 2, "s", 8)
    got = run_op(
        lambda a, b_, c: ops.scaled_dot_product_attention(a, b_, c, causal=True),
        symbolic_input(q, shape),
        symbolic_input(k, (2, 1, "s", 8)),
        symbolic_input(v, (2, 1, "s", 8)),
        dims={"s": s},
    )
    assert_close("attention", got, _sdpa(q, k, v, _allowed(s, s, causal=True), gqa=True))


def test_sdpa_decode_step_with_symbolic_cache_length(run_op, assert_close, rng, symbolic_input):
    """One new query against a cache of ``p + 1`` keys: the causal mask must let it see every key."""
    for p in (0, 4):
        q, k, v = _qkv(rng, s=1, t=p + 1)
        kv_shape = (2, 4, "p + 1", 8)
        got = run_op(
            lambda a, b_, c: ops.scaled_dot_product_attention(a, b_, c, causal=True),
            q,
            symbolic_input(k, kv_shape),
            symbolic_input(v, kv_shape),
            dims={"p": p},
        )
        assert_close("attention", got, _sdpa(q, k, v))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_sdpa_low_precision(dtype, run_op, assert_close, rng):
    q, k, v = _qkv(rng, hkv=2, s=5, t=7, dtype=dtype)
    key_mask = np.array([[1] * 6 + [0], [1] * 7], dtype=bool)
    got = run_op(
        lambda a, b_, c, m: ops.scaled_dot_product_attention(a, b_, c, causal=True, key_mask=m),
        q,
        k,
        v,
        key_mask,
    )
    assert_close(
        "attention", got, _sdpa(q, k, v, _allowed(5, 7, causal=True, key_mask=key_mask), gqa=True), dtype
    )


def test_sdpa_row_with_every_key_masked_averages_values(run_op):
    """Documented difference (tests/TOLERANCES.md): a finite mask bias gives a uniform row, torch's SDPA 0."""
    q, k, v = _qkv(rng=np.random.default_rng(5), b=1, h=1, hkv=1, s=2, t=3)
    key_mask = np.array([[0, 0, 0]], dtype=bool)
    got = run_op(
        lambda a, b_, c, m: ops.scaled_dot_product_attention(a, b_, c, key_mask=m), q, k, v, key_mask
    )
    np.testing.assert_allclose(got[0, 0], np.broadcast_to(v[0, 0].mean(0), (2, 8)), rtol=1e-6)


def _allowed_at(positions, t, window=None):
    """Causal (and windowed) mask [1, 1, S, T] for queries at absolute ``positions`` over keys 0..T-1."""
    q_pos = torch.tensor(positions)[:, None]
    k_pos = torch.arange(t)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    return allowed[None, None]


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("positions", [[4], [0, 1, 2], [5, 6, 7, 8]])
def test_sdpa_at_given_positions_over_a_longer_cache(positions, window, run_op, assert_close, rng):
    """Queries at absolute positions (a KV cache attended over T >= filled keys): keys past each query's
    position are masked, also the not-yet-written ones at the end of the cache."""
    s, t = len(positions), 12
    q, k, v = _qkv(rng, h=4, hkv=2, s=s, t=t)
    pos = np.array(positions, dtype=np.int32)
    got = run_op(lambda a, b_, c, p: ops.scaled_dot_product_attention(a, b_, c, causal=True, window=window,
                                                                      positions=p), q, k, v, pos)
    assert_close("attention", got, _sdpa(q, k, v, _allowed_at(positions, t, window), gqa=True))
