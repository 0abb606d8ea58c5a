"""Sampler and score: token selection statistics, stop handling, HF parity, sharding, compile count."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.sampling import (
    FINISH_EOS, FINISH_LENGTH, FINISH_STOP, SamplerConfig, pick_bucket, power_of_two_buckets,
    sample_tokens, stop_sequence_hit,
)


# ------------------------------------------------------------------------------ pure pieces


def test_buckets():
    assert power_of_two_buckets(16, 100) == (16, 32, 64, 100)
    assert power_of_two_buckets(1, 8) == (1, 2, 4, 8)
    assert pick_bucket(17, (16, 32), "prompt length") == 32
    assert pick_bucket(16, (16, 32), "prompt length") == 16
    with pytest.raises(ValueError, match="prompt length 33 exceeds the largest bucket 32"):
        pick_bucket(33, (16, 32), "prompt length")
    cfg = SamplerConfig(max_prompt_len=64, max_batch=6)
    assert cfg.prompt_bucket_list() == (16, 32, 64)
    assert cfg.batch_bucket_list() == (1, 2, 4, 6)
    assert cfg.batch_bucket_list(4) == (4, 8)  # rounded up to the data-parallel size
    with pytest.raises(ValueError, match="prompt_buckets"):
        SamplerConfig(prompt_buckets=(32, 16))


def _chi2_crit(dof: int, z: float = 3.719) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 3.719 is the 1e-4 tail."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def _reference_probs(logits, temperature, top_k, top_p):
    """Independent numpy version of temperature -> top-k -> top-p (transformers' order)."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(z.shape, bool)
    k = len(z) if top_k == 0 else top_k
    keep[order[:k]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    cum = np.cumsum(p[order])
    n_keep = int(np.searchsorted(cum, top_p) + 1)  # smallest prefix with mass >= top_p
    keep_p = np.zeros_like(keep)
    keep_p[order[:n_keep]] = True
    p = np.where(keep_p, p, 0.0)
    return p / p.sum()


_sample_jit = jax.jit(sample_tokens)


def _draw(logits, n, temperature, top_k, top_p, seed=0):
    b = np.broadcast_to(np.asarray(logits, np.float32), (n, len(logits)))
    toks = _sample_jit(jnp.asarray(b), jax.random.key(seed), jnp.full((n,), temperature, jnp.float32),
                       jnp.full((n,), top_k, jnp.int32), jnp.full((n,), top_p, jnp.float32))
    return np.bincount(np.asarray(toks), minlength=len(logits))


LOGITS = np.array([1.2, -0.3, 0.5, 2.0, -1.0, 0.1, 0.9], np.float32)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 3, 1.0),
                                                     (1.0, 0, 0.75), (0.8, 4, 0.8)])
def test_sample_frequencies_match_truncated_softmax(temperature, top_k, top_p):
    n = 40_000
    counts = _draw(LOGITS, n, temperature, top_k, top_p)
    p = _reference_probs(LOGITS, temperature, top_k, top_p)
    assert np.all(counts[p == 0] == 0), (counts, p)  # truncated tokens are never drawn
    kept = p > 0
    chi2 = float((((counts - n * p) ** 2)[kept] / (n * p[kept])).sum())
    dof = int(kept.sum()) - 1
    if dof > 0:
        assert chi2 < _chi2_crit(dof), (chi2, counts, n * p)
    # Power check: the same counts clearly reject the untruncated, untempered softmax.
    q = np.exp(LOGITS - LOGITS.max()) / np.exp(LOGITS - LOGITS.max()).sum()
    if not np.allclose(p, q, atol=1e-3):
        chi2_wrong = float(((counts - n * q) ** 2 / (n * q)).sum())
        assert chi2_wrong > _chi2_crit(len(q) - 1)


def test_top_k_and_top_p_support():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 50)).astype(np.float32) * 2
    top_k = rng.integers(0, 6, size=64).astype(np.int32)
    top_p = rng.uniform(0.2, 1.0, size=64).astype(np.float32)
    for seed in range(5):
        toks = np.asarray(_sample_jit(jnp.asarray(logits), jax.random.key(seed), jnp.ones(64), jnp.asarray(top_k),
                                      jnp.asarray(top_p)))
        for b in range(64):
            assert _reference_probs(logits[b], 1.0, top_k[b], top_p[b])[toks[b]] > 0


def test_greedy_rows_and_mixed_rows():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(8, 30)), jnp.float32)
    temp = jnp.asarray([0.0, 1.0] * 4, jnp.float32)
    toks = np.asarray(_sample_jit(logits, jax.random.key(3), temp, jnp.full((8,), 2, jnp.int32), jnp.ones(8)))
    np.testing.assert_array_equal(toks[::2], np.argmax(np.asarray(logits), -1)[::2])
    top2 = np.argsort(-np.asarray(logits), -1)[:, :2]
    assert all(toks[b] in top2[b] for b in range(1, 8, 2))


def test_same_key_same_tokens():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(16, 100)), jnp.float32)
    args = (jnp.ones(16), jnp.zeros(16, jnp.int32), jnp.full((16,), 0.9))
    a = _sample_jit(logits, jax.random.key(5), *args)
    b = _sample_jit(logits, jax.random.key(5), *args)
    c = _sample_jit(logits, jax.random.key(6), *args)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_stop_sequence_hit():
    w = 4
    stops = np.full((3, w), -1, np.int32)
    stops[0, 2:] = [7, 8]  # right-aligned [7, 8]
    stops[1, 3:] = [9]
    lens = np.array([2, 1, 0], np.int32)  # third row is padding
    window = np.array([[-1, -1, 7, 8],  # ends with [7, 8]
                       [1, 7, 8, 2],  # contains it, but not at the end
                       [-1, -1, -1, 9],  # ends with [9]
                       [-1, -1, -1, 8],  # only the tail of [7, 8]: the 7 was in the prompt
                       [-1, -1, -1, -1]], np.int32)
    hit = np.asarray(stop_sequence_hit(jnp.asarray(window), jnp.asarray(stops), jnp.asarray(lens)))
    np.testing.assert_array_equal(hit, [True, False, True, False, False])
