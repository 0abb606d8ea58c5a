"""Pieces of rollout/scoring.py and rollout/warmstart.py that the end-to-end launch tests cannot pin
down: the log-prob window of the update / scoring / SFT (equal to the full head on every trained token), length-sorted
scoring, the row pieces of strata_jax/batch.py they share with the update, and bucketed SFT batches."""

import types

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import pytest
from flax import nnx

from rollout import scoring, warmstart
from strata_jax import sft
from strata_jax.batch import TokenBatch, check_window, has_signal, pad_token_rows, token_order, trim_rows, trim_width
from strata_jax.cost import Work
from strata_jax.models.config import ModelConfig
from strata_jax.models.qwen2 import Decoder
from strata_jax.sampling import score
from strata_jax.train import sequence_logprobs

V = 64


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(
        arch="qwen2",
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
        qkv_bias=True,
    )
    return nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))


def _rows(n: int, length: int, max_resp: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, V, rng.integers(3, length - max_resp)).astype(np.int32) for _ in range(n)]
    resps = [rng.integers(1, V, rng.integers(1, max_resp + 1)).astype(np.int32) for _ in range(n)]
    return pad_token_rows(prompts, resps, [np.zeros(len(r), np.float32) for r in resps], length, n, pad_id=0)


def test_windowed_logprobs_equal_the_full_head_on_the_window(model):
    graphdef, params = model
    pk = _rows(6, 24, 5)
    tok, att = jnp.asarray(pk["tokens"]), jnp.asarray(pk["attention_mask"])
    full, ent_full = sequence_logprobs(graphdef, params, tok, att, 8192, True)
    win, ent_win = sequence_logprobs(graphdef, params, tok, att, 8192, True, window=7)
    np.testing.assert_allclose(np.asarray(win)[:, -7:], np.asarray(full)[:, -7:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ent_win)[:, -7:], np.asarray(ent_full)[:, -7:], rtol=1e-5, atol=1e-6)
    assert not np.asarray(win)[:, :-7].any()
    # the SFT loss is the same with and without the window once it covers every response
    args = (params, graphdef, tok, att, jnp.asarray(pk["loss_mask"]), 8192)
    assert float(sft.nll(*args, window=5)) == pytest.approx(float(sft.nll(*args)), rel=1e-6)


def _fake_run(graphdef, rows: int, window: int):
    config = mlc.ConfigDict(
        {
            "train": {
                "mini_batch_rows": rows,
                "length_buckets": (8, 16, 24, 32),
                "logprob_chunk": 8192,
                "shared_prefix": False,
                "prefix_tree": False,
            }
        }
    )
    return types.SimpleNamespace(
        config=config, window=window, graphdef=graphdef, pad_id=0, work={"score": Work(), "update": Work()}
    )


def test_score_rows_equals_the_sampler_score_on_loss_tokens(model):
    graphdef, params = model
    pk = _rows(11, 32, 4, seed=1)
    pk["loss_mask"][3] = False  # a row without loss tokens is skipped (zeros)
    got = scoring.score_rows(_fake_run(graphdef, 4, 6), params, pk["tokens"], pk["attention_mask"], pk["loss_mask"])
    want = np.where(pk["loss_mask"], score(graphdef, params, pk["tokens"], pk["attention_mask"]), 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reference", [True, False])
def test_score_batch_runs_the_reference_pass_only_with_reference_params(model, reference):
    """A run without a KL term keeps no reference params (Run: train.kl_coef = 0): score_batch
    then fills ref_logp with zeros and runs one scoring pass (the old policy's), not two."""
    graphdef, params = model
    pk = _rows(6, 24, 4, seed=3)
    ref_params = jax.tree.map(lambda x: x * 0.5, params)  # a reference that differs from the policy
    run = _fake_run(graphdef, 4, 6)
    run.config.train.recompute_old_logp = True
    run.reference_params = lambda: ref_params if reference else None
    tb = types.SimpleNamespace(
        tokens=pk["tokens"],
        attention_mask=pk["attention_mask"],
        loss_mask=pk["loss_mask"],
        old_logp=np.zeros(pk["tokens"].shape, np.float32),
        replace=lambda **kw: kw,
    )
    got = scoring.score_batch(run, tb, params)
    one = Work()
    scoring.score_rows(
        types.SimpleNamespace(**{**vars(run), "work": {"score": one}}),
        params,
        pk["tokens"],
        pk["attention_mask"],
        pk["loss_mask"],
    )
    want_old = np.where(pk["loss_mask"], score(graphdef, params, pk["tokens"], pk["attention_mask"]), 0.0)
    np.testing.assert_allclose(got["old_logp"], want_old, rtol=1e-5, atol=1e-6)
    if reference:
        want_ref = np.where(pk["loss_mask"], score(graphdef, ref_params, pk["tokens"], pk["attention_mask"]), 0.0)
        np.testing.assert_allclose(got["ref_logp"], want_ref, rtol=1e-5, atol=1e-6)
        assert run.work["score"].tokens == 2 * one.tokens
    else:
        assert not got["ref_logp"].any() and got["ref_logp"].shape == pk["tokens"].shape
        assert run.work["score"].tokens == one.tokens > 0


def test_a_response_longer_than_the_window_is_refused(model):
    graphdef, params = model
    pk = _rows(4, 16, 6, seed=2)
    with pytest.raises(ValueError, match="log-prob window"):
        scoring.score_rows(
            _fake_run(graphdef, 4, 2), params, pk["tokens"], pk["attention_mask"], np.ones_like(pk["loss_mask"])
        )


def test_row_views_of_a_token_batch_by_hand():
    """strata_jax.batch's pure row pieces the update and the scoring share: trim_rows cuts to the
    mini-batch's own bucket, check_window refuses a loss token left of the window, has_signal reads
    valid loss tokens only, token_order puts rows with a shared prefix side by side."""
    pk = pad_token_rows(
        [np.asarray([5, 6, 7], np.int32), np.asarray([5, 9], np.int32)],
        [np.asarray([1, 2], np.int32), np.asarray([3], np.int32)],
        [np.zeros(2, np.float32), np.zeros(1, np.float32)],
        16,
        3,
    )
    zeros = np.zeros(pk["tokens"].shape, np.float32)
    tb = TokenBatch(
        tokens=pk["tokens"],
        attention_mask=pk["attention_mask"],
        loss_mask=pk["loss_mask"],
        old_logp=zeros,
        ref_logp=zeros,
        advantage=zeros,
        row_index=np.zeros((3, 4), np.int32),
        row_valid=pk["row_valid"],
    )
    assert trim_width(pk["attention_mask"], (4, 8, 16)) == 8  # 5 tokens -> bucket 8
    assert trim_width(pk["attention_mask"], (2, 4)) == 16  # no bucket holds them: the rows' own width
    cut = trim_rows(tb, (4, 8, 16))
    assert cut.tokens.shape == (3, 8) and (cut.tokens == pk["tokens"][:, -8:]).all()
    assert cut.row_index.shape == (3, 4) and cut.row_valid.tolist() == [True, True, False]
    check_window(pk["loss_mask"], 2)
    with pytest.raises(ValueError, match="log-prob window"):
        check_window(pk["loss_mask"], 1)
    assert not has_signal(tb)
    adv = zeros.copy()
    adv[0, 0] = 1.0  # off the loss mask: no signal
    assert not has_signal(tb.replace(advantage=adv))
    adv[1, -1] = -0.5  # row 1's response token
    assert has_signal(tb.replace(advantage=adv))
    assert not has_signal(tb.replace(advantage=adv, row_valid=np.asarray([True, False, False])))
    tokens = np.asarray([[0, 4, 5], [3, 3, 9], [0, 3, 3]], np.int32)
    mask = tokens > 0
    assert token_order(tokens, mask, np.arange(3)).tolist() == [2, 1, 0]  # [3, 3] < [3, 3, 9] < [4, 5]


def test_sft_batches_come_from_one_length_bucket():
    lengths = [5, 9, 9, 15, 30, 31, 7]
    groups = warmstart.length_groups(lengths, (8, 16, 32))
    assert {k: sorted(v.tolist()) for k, v in groups.items()} == {8: [0, 6], 16: [1, 2, 3], 32: [4, 5]}
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(50):
        length, idx = warmstart.sft_batch(groups, 4, rng)
        assert len(idx) == 4 and all(lengths[i] <= length for i in idx)
        assert set(idx.tolist()) <= set(groups[length].tolist())
        seen.add(length)
    assert seen == {8, 16, 32}
    with pytest.raises(ValueError, match="exceeds the largest"):
        warmstart.length_groups([40], (8, 16, 32))
