"""Farthest-point strategy selection: constructed cases, duplicates, masks, a slow numpy reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_jax.diversity import farthest_point_select, first_n


def fps(emb, mask, score, n):
    idx, kept = farthest_point_select(
        np.asarray(emb, np.float32), np.asarray(mask, bool), np.asarray(score, np.float32), n
    )
    return np.asarray(idx), np.asarray(kept)


def slow_fps(emb, mask, score, n):
    """One task, explicit loops: start at the best score, then max-min cosine distance."""

    def dist(i, j):
        a, b = emb[i].astype(np.float64), emb[j].astype(np.float64)
        return 1.0 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b))

    valid = [k for k in range(len(mask)) if mask[k]]
    if not valid:
        return []
    chosen = [max(valid, key=lambda k: (score[k], -k))]
    while len(chosen) < min(n, len(valid)):
        rest = [k for k in valid if k not in chosen]
        chosen.append(max(rest, key=lambda k: (min(dist(k, c) for c in chosen), score[k], -k)))
    return chosen


def test_constructed_farthest_points():
    emb = [[[1, 0], [0.9, 0.1], [-1, 0], [0, 1]]]
    idx, kept = fps(emb, [[1, 1, 1, 1]], [[0.0, -1.0, -2.0, -3.0]], 3)
    # start a (best score); c is opposite (distance 2); then d (distance 1 to both) beats b.
    assert idx.tolist() == [[0, 2, 3]] and kept.all()
    idx, _ = fps(emb, [[1, 1, 1, 1]], [[-5.0, -1.0, -2.0, -3.0]], 2)
    assert idx.tolist() == [[1, 2]]  # start moves to the new best score


def test_duplicates_only_after_distinct_ones():
    x, y, z = [1, 0, 0], [0, 1, 0], [0, 0, 1]
    emb = [[x, x, y, x, y, z]]
    idx, kept = fps(emb, [[1] * 6], [[0.0, 0.5, -1.0, 0.2, -0.5, -9.0]], 3)
    assert sorted(idx[0].tolist()) == [1, 4, 5] and kept.all()  # best-scoring copy of each
    idx, kept = fps(emb, [[1] * 6], [[0.0, 0.5, -1.0, 0.2, -0.5, -9.0]], 5)
    assert len(set(idx[0].tolist())) == 5 and kept.all()
    assert sorted(idx[0, :3].tolist()) == [1, 4, 5]  # the distinct ones come first


def test_mask_and_too_few_candidates():
    emb = [[[1, 0], [-1, 0], [0, 1], [0, -1]], [[1, 0], [-1, 0], [0, 1], [0, -1]]]
    mask = [[1, 0, 1, 0], [0, 0, 0, 0]]
    idx, kept = fps(emb, mask, [[0, 9, 0, 9], [0, 0, 0, 0]], 3)
    assert kept.tolist() == [[True, True, False], [False, False, False]]
    assert sorted(idx[0, :2].tolist()) == [0, 2]  # masked candidates never picked, even the best
    assert idx[0, 0] == 0  # tie on score -> lower index


@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 6))
def test_matches_slow_reference(seed, n):
    rng = np.random.default_rng(seed)
    P, K, D = 3, 8, 5
    emb = rng.normal(size=(P, K, D)).astype(np.float32)
    emb[:, 3] = emb[:, 1]  # an exact duplicate in every task
    mask = rng.random((P, K)) < 0.7
    score = rng.normal(size=(P, K)).astype(np.float32)
    idx, kept = fps(emb, mask, score, n)
    for p in range(P):
        want = slow_fps(emb[p], mask[p], score[p], n)
        assert idx[p, : len(want)].tolist() == want
        assert kept[p].tolist() == [i < len(want) for i in range(n)]


def test_first_n():
    idx, kept = first_n(np.array([[0, 1, 1, 0, 1], [1, 0, 0, 0, 0]], bool), 3)
    assert np.asarray(idx)[0].tolist() == [1, 2, 4]
    assert np.asarray(kept).tolist() == [[True] * 3, [True, False, False]]
    assert np.asarray(idx)[1, 0] == 0


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="mask"):
        fps(np.zeros((1, 4, 2)), np.ones((1, 3)), np.zeros((1, 4)), 2)
    with pytest.raises(ValueError, match="n must be"):
        fps(np.zeros((1, 4, 2)), np.ones((1, 4)), np.zeros((1, 4)), 5)
    with pytest.raises(ValueError, match="first_n"):
        first_n(np.ones((2, 3), bool), 4)
