"""Shared prompt prefixes in the update and the scoring (strata_jax/packing.py,
train.shared_sequence_logprobs, `train.shared_prefix`): the packed rows hold exactly the original
tokens, their log-probs are `sequence_logprobs` of the unshared rows (the independent reference),
and a train step on the packed batch gives the unshared step's loss, metrics and parameters, with
micro-batches, on an 8-device mesh and under scan_layers."""

import types
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout.scoring import score_rows
from strata_jax import sharding as sh
from strata_jax import train as T
from strata_jax.batch import TokenBatch
from strata_jax.cost import Work
from strata_jax.models.config import ModelConfig
from strata_jax.models.tiny import init_params
from strata_jax.packing import SharedBatch, length_buckets, pack_shared
from tests.test_train import FAST, LOSS, OPT, TINY, tiny_model, to_numpy

VOCAB = 64
# A larger init than the train tests' default: the rows' log-probs then differ by O(1), so a token
# given another row's prefix, or a wrong position, shows far above the tolerance.
INIT = dict(initializer_range=0.3)


def _rows(seed=0, S=16, L=48):
    """Hand-made rows, left-padded [S, L]: two groups sharing a prompt prefix (one with two identical
    step-0 prompts, one with a shorter prefix), a row sharing nothing, a strategy row, padding rows."""
    r = np.random.default_rng(seed)
    tok = lambda n: [int(x) for x in r.integers(1, VOCAB, n)]  # noqa: E731
    a, b = tok(22), tok(17)
    prompts = (
        [a + tok(n) for n in (3, 6, 1, 9)]  # group a: own step suffixes
        + [b, b, b + tok(5), b[:14] + tok(4)]  # group b: step 0 twice; a row sharing 14 of b's tokens
        + [tok(15)]  # shares nothing
        + [a + tok(2)]  # a strategy row under a
        + [tok(30), a + tok(12)]
    )  # a long lone row; a longer one of group a
    responses = [tok(int(n)) for n in r.integers(3, 8, len(prompts))]
    tokens = np.zeros((S, L), np.int32)
    attn = np.zeros((S, L), bool)
    loss = np.zeros((S, L), bool)
    for s, (p, resp) in enumerate(zip(prompts, responses)):
        row = p + resp
        assert len(row) <= L
        tokens[s, L - len(row) :] = row
        attn[s, L - len(row) :] = True
        loss[s, L - len(resp) :] = r.random(len(resp)) < 0.85
        loss[s, L - len(resp)] = True  # the first response token: right after the prompt's last token
    valid = attn.any(axis=1)  # the last rows are padding
    row_index = np.zeros((S, 4), np.int32)
    row_index[:, 3] = np.arange(S)
    row_index[len(prompts) - 3, 3] = -1  # the strategy row
    adv = np.repeat(r.normal(size=(S, 1)), L, 1)
    z = lambda x: np.where(loss, x, 0.0).astype(np.float32)  # noqa: E731
    return TokenBatch(
        tokens=tokens,
        attention_mask=attn,
        loss_mask=loss,
        old_logp=z(-np.log(VOCAB) + r.normal(0, 0.5, (S, L))),
        ref_logp=z(-np.log(VOCAB) + r.normal(0, 0.5, (S, L))),
        advantage=z(adv),
        row_index=row_index,
        row_valid=valid,
    )


def _pack(b, micro_batches=1, data_parallel=1, pair=0.0, steps=2):
    out = pack_shared(b, micro_batches, data_parallel, min_prefix=8, min_saving=0.0, pair=pair, steps=steps)
    assert out is not None
    return out


def _unpack(sb: SharedBatch, order, shape):
    """The packed rows' [S, Ls] fields back in the input's [S, L] coordinates (0 off the suffix)."""
    ls = sb.rows.tokens.shape[1]
    c = min(ls, shape[1])
    out = {}
    for f in ("tokens", "attention_mask", "loss_mask", "old_logp", "ref_logp", "advantage"):
        x = np.asarray(getattr(sb.rows, f))
        y = np.zeros(shape, x.dtype)
        y[order, -c:] = x[:, -c:]
        out[f] = y
    return out


@pytest.mark.parametrize("steps", [2, 8])
@pytest.mark.parametrize("k,dp", [(1, 1), (2, 1), (2, 4)])
def test_packing_keeps_every_token_and_shares(k, dp, steps):
    b = _rows()
    sb, order = _pack(b, k, dp, steps=steps)
    if steps > 2:  # finer widths: never more slots than the half steps' plan
        assert sb.model_tokens <= _pack(b, k, dp)[0].model_tokens
    s, length = b.tokens.shape
    assert sorted(order.tolist()) == list(range(s))
    u, tpre = sb.prefix_tokens.shape
    assert u % (k * dp) == 0 and sb.micro_batches == k
    assert sb.model_tokens < s * length  # it saves tokens
    assert (~sb.prefix_mask.any(axis=1)).any()  # all-padding prefix slots (unused, or rows sharing nothing)
    for p in range(s):
        q = int(sb.row_prefix[p]) * k + p % k  # the row's prefix slot in its own micro-batch
        assert 0 <= sb.row_prefix[p] < u // k
        pre = sb.prefix_tokens[q][sb.prefix_mask[q]].tolist()
        suf = np.asarray(sb.rows.tokens[p])[np.asarray(sb.rows.attention_mask[p])].tolist()
        r = order[p]
        assert pre + suf == b.tokens[r][b.attention_mask[r]].tolist()
        assert len(suf) >= 1 or not b.attention_mask[r].any()  # padding rows are empty
        # the suffix starts with a prompt token: the first response token is predicted inside it
        first = np.flatnonzero(np.asarray(sb.rows.attention_mask[p]))
        if len(first):
            assert not sb.rows.loss_mask[p, first[0]]
    back = _unpack(sb, order, b.tokens.shape)
    for f in ("loss_mask", "old_logp", "ref_logp", "advantage"):
        np.testing.assert_array_equal(back[f], getattr(b, f))  # every loss token and its values kept
    np.testing.assert_array_equal(np.asarray(sb.rows.row_valid), b.row_valid[order])
    np.testing.assert_array_equal(np.asarray(sb.rows.row_index), b.row_index[order])
    # group a's rows share one prefix per micro-batch; the row that shares nothing gets a private
    # or an empty one
    slot = [(int(sb.row_prefix[p]), p % k) for p in range(s)]
    assert len({slot[p] for p in range(s) if order[p] in (0, 1, 2, 3)}) <= k
    lone = int(np.flatnonzero(order == 8)[0])
    u, j = slot[lone]
    assert Counter(slot)[slot[lone]] == 1 or not sb.prefix_mask[u * k + j].any()


def test_length_buckets_by_hand():
    assert length_buckets(100) == (16, 24, 32, 48, 64, 96, 128)
    assert length_buckets(100, extra=(40, 200)) == (16, 24, 32, 40, 48, 64, 96, 128)
    assert length_buckets(600, smallest=256, steps=8) == (256, 288, 320, 352, 384, 416, 448, 480, 512, 576, 640)
    assert length_buckets(9, smallest=1) == (1, 2, 3, 4, 6, 8, 12)
    assert length_buckets(70, smallest=16, steps=1) == (16, 32, 64, 128)
    with pytest.raises(ValueError, match="steps=3 must be a power of two"):
        length_buckets(100, steps=3)


def test_distinct_prefixes_equal_the_tuple_count():
    """The planner's count of distinct prefixes prompt[:split] (from the sorted rows' common
    prefixes) against building the tuples, on rows with shared prefixes, duplicates and splits at,
    inside and past the shared part."""
    from strata_jax.packing import _common_prefixes, _distinct_prefixes

    r = np.random.default_rng(4)
    for trial in range(200):
        stems = [list(r.integers(1, 5, r.integers(0, 6))) for _ in range(3)]
        prompts = sorted(
            stems[r.integers(3)] + list(r.integers(1, 4, r.integers(1, 8))) for _ in range(r.integers(1, 12))
        )
        splits = np.array([r.integers(0, len(p) + 1) for p in prompts])
        if trial % 3 == 0:  # one split for all (as far as each row reaches): the rows' keys merge
            splits = np.minimum(splits[0], [len(p) for p in prompts])
        want = len({tuple(p[:sp]) for p, sp in zip(prompts, splits)})
        assert _distinct_prefixes(_common_prefixes(prompts), splits) == want, (prompts, splits)


def test_prefix_tree_tokens_by_hand():
    """The trie's nodes over the prompts plus the tails: prompts [1 2 3], [1 2 4], [1 2 4], [5]
    have the distinct prefixes 1, 1 2, 1 2 3, 1 2 4 and 5 (5 tokens), then 4 response tokens; a
    padding row adds nothing. Never more than the real tokens, and pack_shared runs no fewer."""
    from strata_jax.packing import prefix_tree_tokens

    rows = [([1, 2, 3], [9]), ([1, 2, 4], [8]), ([1, 2, 4], [7]), ([5], [6])]
    L = 6
    tokens, mask, loss = np.zeros((5, L), np.int32), np.zeros((5, L), bool), np.zeros((5, L), bool)
    for i, (p, r) in enumerate(rows):
        tokens[i, L - len(p + r) :] = p + r
        mask[i, L - len(p + r) :] = True
        loss[i, L - len(r) :] = True
    z = np.zeros((5, L), np.float32)
    tb = TokenBatch(
        tokens=tokens,
        attention_mask=mask,
        loss_mask=loss,
        old_logp=z,
        ref_logp=z,
        advantage=z,
        row_index=np.zeros((5, 4), np.int32),
        row_valid=mask.any(axis=1),
    )
    assert prefix_tree_tokens(tb) == 5 + 4
    b = _rows()
    assert prefix_tree_tokens(b) <= int(b.attention_mask.sum())
    assert prefix_tree_tokens(b) <= _pack(b)[0].model_tokens


def test_packing_without_sharing_or_with_bad_rows():
    b = _rows()
    # full-length random rows share nothing, and private prefixes cannot pad less than S x L
    full = np.ones_like(b.attention_mask)
    lone = b.replace(
        tokens=np.random.default_rng(1).integers(1, VOCAB, b.tokens.shape).astype(np.int32),
        attention_mask=full,
        loss_mask=full & (np.arange(b.tokens.shape[1]) >= 40),
    )
    assert pack_shared(lone, min_prefix=8, min_saving=0.0) is None
    with pytest.raises(ValueError, match="not left-padded"):
        bad = b.attention_mask.copy()
        bad[0, -3] = False
        pack_shared(b.replace(attention_mask=bad, loss_mask=b.loss_mask & bad))
    with pytest.raises(ValueError, match="loss token at their first real token"):
        lm = b.loss_mask.copy()
        lm[0, np.argmax(b.attention_mask[0])] = True
        pack_shared(b.replace(loss_mask=lm))
    with pytest.raises(ValueError, match="divisible by micro_batches=3"):
        pack_shared(b, micro_batches=3)


def _logprobs(g, p, b, sb, window=None, g_shared=None):
    """Plain (graphdef g) and shared (g_shared, default g) log-probs and entropies."""
    plain = jax.jit(T.sequence_logprobs, static_argnums=(0, 4, 5, 6), compiler_options=FAST)(
        g, p, jnp.asarray(b.tokens), jnp.asarray(b.attention_mask), 8192, True, window
    )
    shared = jax.jit(T.shared_batch_logprobs, static_argnums=(0, 3, 4, 5), compiler_options=FAST)(
        g if g_shared is None else g_shared, p, sb, 8192, True, window
    )
    return [np.asarray(x) for x in plain], [np.asarray(x) for x in shared]


@pytest.mark.parametrize(
    "scan_layers,window,attention",
    [(False, None, "einsum"), (False, 10, "einsum"), (True, None, "einsum"), (False, None, "xla")],
)
def test_shared_logprobs_equal_sequence_logprobs(scan_layers, window, attention):
    """attention "xla": the shared rows run the fused attention (model.attention, the prefix pass
    and the suffixes against its cache), the reference the plain einsum rows."""
    if scan_layers:  # the stacked [L, B, K, S, Dh] cache
        g, p = init_params(ModelConfig.from_hf({**TINY, **INIT}, scan_layers=True), seed=0)
    else:
        g, p = tiny_model(**INIT)
    g_shared = None
    if attention != "einsum":
        g_shared, p2 = init_params(ModelConfig.from_hf({**TINY, **INIT}, attention=attention), seed=0)
        assert jax.tree.structure(p2) == jax.tree.structure(p)
    b = _rows()
    sb, order = _pack(b, pair=0.01)
    (lp, ent), (slp, sent) = _logprobs(g, p, b, sb, window, g_shared)
    back = _unpack(sb, order, b.tokens.shape)
    mask = back["loss_mask"]
    assert mask.sum() == b.loss_mask.sum() > 40
    want_lp, got_lp = lp[mask], np.zeros(b.tokens.shape, np.float32)
    c = min(slp.shape[1], b.tokens.shape[1])
    got_lp[order, -c:] = slp[:, -c:]
    got_ent = np.zeros_like(got_lp)
    got_ent[order, -c:] = sent[:, -c:]
    np.testing.assert_allclose(got_lp[mask], want_lp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got_ent[mask], ent[mask], atol=1e-5, rtol=1e-5)
    assert np.ptp(want_lp) > 1.0  # the rows' log-probs differ: a wrong prefix or position would show
    if window is None:
        # every suffix token but its first real one (its predecessor is in the prefix)
        sm = back["attention_mask"].copy()
        sm[np.arange(sm.shape[0]), np.argmax(sm, axis=1)] = False
        np.testing.assert_allclose(got_lp[sm], lp[sm], atol=1e-5, rtol=1e-5)


def _steps(mesh, batch, micro_batches, params):
    g, _ = tiny_model(**INIT)
    opt = T.make_optimizer(OPT)
    step = T.make_train_step(
        g, opt, LOSS, mesh, sh.DEFAULT_RULES, micro_batches, logprob_window=12, compiler_options=FAST
    )
    state = T.init_train_state(g, params, opt, 0, mesh, sh.DEFAULT_RULES)
    state, m = step(state, batch, 0.5)
    return to_numpy(state.params), {k: float(v) for k, v in m.items()}


@pytest.mark.parametrize("micro_batches,mesh_shape", [(1, None), (2, None), (2, {"data": 2, "fsdp": 4})])
def test_train_step_shared_equals_unshared(micro_batches, mesh_shape):
    g, p = tiny_model(**INIT)
    b = _rows()
    if mesh_shape is not None:  # 32 rows: 8 devices x 2 micro-batches need 16 prefix slots or more
        b = jax.tree.map(lambda x, y: np.concatenate([x, y]), b, _rows(seed=1))
    one = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    mesh = one if mesh_shape is None else sh.make_mesh(mesh_shape)
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    sb, _ = _pack(b, micro_batches, dp)
    check_same_step(one, b, mesh, sb, micro_batches, p)


def check_same_step(one, b, mesh, packed, micro_batches, p):
    """A step on the plain TokenBatch b (mesh `one`) and on its packed form (`mesh`) from params p:
    the same metrics and parameters, and a real update."""
    want_p, want_m = _steps(one, b, micro_batches, jax.tree.map(jnp.copy, p))
    got_p, got_m = _steps(mesh, packed, micro_batches, jax.tree.map(jnp.copy, p))
    assert want_m["applied"] == 1 and want_m["tokens"] == b.loss_mask.sum()
    assert set(got_m) == set(want_m)
    for k, v in want_m.items():
        np.testing.assert_allclose(got_m[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
    base = to_numpy(p)
    assert max(np.abs(w - x).max() for w, x in zip(want_p, base)) > 1e-4  # the update is real
    for w, x in zip(want_p, got_p):
        np.testing.assert_allclose(x, w, rtol=1e-5, atol=1e-6)


def one_device_step():
    """(a one-micro-batch train step on one device, its state) for the refusal tests."""
    g, p = tiny_model(**INIT)
    mesh = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    opt = T.make_optimizer(OPT)
    step = T.make_train_step(g, opt, LOSS, mesh, micro_batches=1)
    return step, T.init_train_state(g, p, opt, 0, mesh)


def test_step_refuses_a_batch_packed_for_other_micro_batches():
    step, state = one_device_step()
    sb, _ = _pack(_rows(), micro_batches=2)
    with pytest.raises(ValueError, match="packed for micro_batches=2"):
        step(state, sb, 0.5)


def test_score_rows_shared_equals_plain(monkeypatch):
    """rollout/scoring.score_rows with train.shared_prefix on and off (the tiny model's attention
    weight in the plan cost): the same log-probs."""
    import rollout.scoring

    packed = []

    def pack(*a, **kw):
        packed.append(pack_shared(*a, **kw))
        return packed[-1]

    monkeypatch.setattr(rollout.scoring, "pack_shared", pack)
    g, p = tiny_model(**INIT)
    b = _rows()

    def run(shared):
        train = types.SimpleNamespace(
            mini_batch_rows=8,
            length_buckets=(16, 32, 48),
            logprob_chunk=8192,
            shared_prefix=shared,
            bucket_steps=2,
            prefix_tree=False,
        )
        return types.SimpleNamespace(
            config=types.SimpleNamespace(train=train),
            window=12,
            graphdef=g,
            pad_id=0,
            mesh=sh.make_mesh((1, 1, 1), devices=jax.devices()[:1]),
            plan_model=ModelConfig.from_hf(TINY),
            work={"score": Work()},
        )

    args = (p, b.tokens, b.attention_mask, b.loss_mask)
    plain_run, shared_run = run(False), run(True)
    plain, shared = score_rows(plain_run, *args), score_rows(shared_run, *args)
    # the counted work (strata_jax/cost.py): the shared prefixes ran once
    assert 0 < shared_run.work["score"].tokens < plain_run.work["score"].tokens
    live = b.loss_mask.any(axis=1)  # the scored rows' real tokens, whichever layout ran them
    n = b.attention_mask[live].sum(axis=1)
    for r in (plain_run, shared_run):
        assert (r.work["score"].real_tokens, r.work["score"].real_pairs) == (n.sum(), (n * n).sum())
    assert np.ptp(plain[b.loss_mask]) > 1.0
    assert len(packed) == 2 and any(x is not None for x in packed)  # a chunk was scored shared
    np.testing.assert_allclose(shared, plain, atol=1e-5, rtol=1e-5)


def test_update_batch_packs_only_with_the_switch_on():
    """rollout/scoring.update_batch (the iteration's update input): a SharedBatch packed for the
    step's micro-batches and data-parallel size with train.shared_prefix, the mini-batch itself
    without."""
    from rollout.scoring import update_batch

    b = _rows()

    def run(shared, micro_batches=2):
        train = types.SimpleNamespace(
            micro_batches=micro_batches,
            length_buckets=(48,),
            shared_prefix=shared,
            bucket_steps=2,
            prefix_tree_update=False,
        )
        return types.SimpleNamespace(
            config=types.SimpleNamespace(train=train),
            plan_model=ModelConfig.from_hf(TINY),
            mesh=sh.make_mesh({"data": 2, "fsdp": 1, "tensor": 4}),
        )

    assert update_batch(run(False), b) is b
    sb = update_batch(run(True), b)
    assert isinstance(sb, SharedBatch) and sb.micro_batches == 2 and sb.prefix_tokens.shape[0] % 4 == 0
    assert sb.model_tokens <= 0.8 * b.tokens.size  # packed only when it saves a fifth
