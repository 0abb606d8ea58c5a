"""bench/iteration.py's `--think-tokens` rows and counts, on hand-built cases."""

import importlib.util
import json
import pathlib
import types

import numpy as np

from strata_jax.batch import TokenBatch
from strata_jax.cost import Work

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_iteration", ROOT / "bench" / "iteration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_with_thoughts_widens_only_the_action_responses():
    bench = _bench()
    tok = np.array([[0, 0, 5, 6, 7, 8], [0, 9, 9, 9, 3, 4], [0, 0, 0, 1, 2, 3], [0, 0, 0, 0, 0, 0]], np.int32)
    mask = tok > 0
    loss = np.zeros_like(mask)
    loss[0, 4:] = loss[1, 4:] = True  # an action row (t = 0) and a strategy row (t = -1)
    loss[2, 5:] = True  # a judgment row (t = H = 3)
    old = np.where(loss, -1.0, 0.0).astype(np.float32)
    zeros = np.zeros(tok.shape, np.float32)
    tb = TokenBatch(
        tokens=tok,
        attention_mask=mask,
        loss_mask=loss,
        old_logp=old,
        ref_logp=zeros,
        advantage=zeros,
        row_index=np.array([[0, 0, 0, 0], [0, 0, 0, -1], [0, 0, 0, 3], [0, 0, 0, 0]], np.int32),
        row_valid=np.array([True, True, True, False]),
    )
    w = bench.with_thoughts(tb, 2, 3, 100, seed=0)
    think = w.tokens[0, 4:6]
    assert (think >= 1).all() and (think < 100).all()
    np.testing.assert_array_equal(
        w.tokens, [[0, 0, 5, 6, *think, 7, 8], [0, 0, 0, 9, 9, 9, 3, 4], [0, 0, 0, 0, 0, 1, 2, 3], [0] * 8]
    )
    np.testing.assert_array_equal(w.attention_mask, w.tokens > 0)
    np.testing.assert_array_equal(
        w.loss_mask, [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1], [0] * 8]
    )
    # the thought's old log-probs are 0 (the scoring recomputes them); the response's keep theirs
    np.testing.assert_array_equal(
        w.old_logp, [[0, 0, 0, 0, 0, 0, -1, -1], [0, 0, 0, 0, 0, 0, -1, -1], [0, 0, 0, 0, 0, 0, 0, -1], [0] * 8]
    )
    np.testing.assert_array_equal(w.row_index, tb.row_index)


def test_thoughts_count_every_action_decode_longer():
    bench = _bench()
    thoughts = types.SimpleNamespace(think=16)
    sampler = types.SimpleNamespace(work=Work())
    bench.Thoughts.count_decodes(thoughts, sampler)
    sampler.work.add_decode(8, 30, 800)
    sampler.work.add_decode(8, 0, 800)  # a call that decoded nothing stays uncounted
    assert sampler.work.decode == [(8, 46, 816)]


def test_saved_counts_model_the_same_again():
    """`--keep` writes the counted work and `--from` reads it back: the same Work, so the same
    modelled seconds."""
    bench = _bench()
    w = Work()
    w.add(tokens=1000, pairs=50000, head_tokens=40, real_tokens=900, real_pairs=40000)
    w.add_decode(16, 30, 800)
    out = {"strata": {"env_steps": 10.0, "work": {"actions": w, "update": w.times(2)}}}
    back = bench.from_json(json.loads(json.dumps(bench.to_json(out))))
    assert back["strata"]["env_steps"] == 10.0
    for phase in ("actions", "update"):
        assert back["strata"]["work"][phase] == out["strata"]["work"][phase]
    assert bench.modelled(back["strata"]["work"], "qwen2.5-7b", 8) == bench.modelled(
        out["strata"]["work"], "qwen2.5-7b", 8
    )
