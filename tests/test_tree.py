"""Rows packed as prefix trees (strata_jax/tree.py, train.tree_logprobs, `train.prefix_tree`): the layout
by hand; on random rows every row's tokens lie on a root path whose mask shows exactly that path
(a brute-force ancestor check); the log-probs equal `sequence_logprobs` of the unpacked rows (the
independent reference); rollout/scoring.score_rows gives the plain rows' log-probs with the trees
on; and a train step on a mini-batch as trees gives the plain step's loss, metrics and parameters,
on one device and split over an 8-device mesh, with micro-batches."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rollout.scoring
from rollout.scoring import score_rows
from strata_jax import sharding as sh
from strata_jax import train as T
from strata_jax.batch import token_order
from strata_jax.cost import Work, batch_work
from strata_jax.models.config import ModelConfig
from strata_jax.models.tiny import init_params
from strata_jax.sampling import _left_pad
from strata_jax.tree import TreeBatch, pack_tree, plan_tree, plan_tree_rows, row_bucket, subtree_ends
from tests.test_train import FAST, TINY, tiny_model
from tests.test_train_shared_prefix import INIT, VOCAB, _rows, check_same_step, one_device_step


def _left(rows, length):
    return _left_pad(rows, len(rows), length, 0)  # left-padded [S, L] tokens and mask


def test_pack_tree_by_hand():
    # sorted rows: B shares 2 tokens with A, C repeats B, D shares nothing
    tokens, mask = _left([[1, 2, 3, 4], [1, 2, 5], [1, 2, 5], [7, 8]], 4)
    tb = pack_tree(tokens, mask, width=16, window=2)
    assert tb.tokens.shape == (1, 16)
    np.testing.assert_array_equal(tb.tokens[0, :7], [1, 2, 3, 4, 5, 7, 8])
    np.testing.assert_array_equal(tb.positions[0, :7], [0, 1, 2, 3, 2, 0, 1])
    # subtree ends: the first later slot no deeper than the slot
    np.testing.assert_array_equal(tb.end[0], [5, 5, 4, 4, 5, 7, 7] + [0] * 9)
    np.testing.assert_array_equal(tb.slots, [[1, 2, 3], [0, 1, 4], [0, 1, 4], [0, 5, 6]])
    np.testing.assert_array_equal(tb.targets, tokens[:, 1:])
    # width 5: D no longer fits after A and B and opens a second packed row, written in full
    tb = pack_tree(tokens, mask, width=5, window=2)
    np.testing.assert_array_equal(tb.tokens, [[1, 2, 3, 4, 5], [7, 8, 0, 0, 0]])
    np.testing.assert_array_equal(tb.end, [[5, 5, 4, 4, 5], [2, 2, 0, 0, 0]])
    np.testing.assert_array_equal(tb.slots[3], [0, 5, 6])  # packed row 1, slots 0 and 1
    with pytest.raises(ValueError, match="does not fit a packed row of width 3"):
        pack_tree(tokens, mask, width=3, window=2)


def test_subtree_ends_and_row_buckets_against_brute_force():
    r = np.random.default_rng(0)
    for _ in range(50):
        depth = np.cumsum(np.r_[0, r.integers(-3, 2, 40)]).clip(0)
        want = [
            next((j for j in range(i + 1, len(depth)) if depth[j] <= depth[i]), len(depth)) for i in range(len(depth))
        ]
        np.testing.assert_array_equal(subtree_ends(depth, len(depth)), want)
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 6, 7, 9, 13)] == [1, 2, 3, 4, 6, 6, 8, 12, 16]


def _random_rows(seed, n=24, length=40):
    """Sorted rows with shared prefixes at several depths, repeats, and a few rows sharing nothing."""
    r = np.random.default_rng(seed)
    trunk = [int(x) for x in r.integers(1, VOCAB, 12)]
    rows = []
    for _ in range(n):
        k = int(r.integers(0, 13))
        row = trunk[:k] + [int(x) for x in r.integers(1, 4, int(r.integers(1, length - k)))]  # small alphabet: repeats
        rows.append(row[:length])
    rows.append([])  # a padding row
    tokens, mask = _left(rows, length)
    order = token_order(tokens, mask, np.arange(len(rows)))
    return tokens[order], mask[order]


@pytest.mark.parametrize("width,blocks", [(40, 1), (64, 1), (128, 5), (512, 1)])
def test_every_row_lies_on_a_root_path_that_its_mask_shows(width, blocks):
    tokens, mask = _random_rows(1)
    s, length = tokens.shape
    tb = pack_tree(tokens, mask, width, length - 1, blocks)
    r, t = tb.tokens.shape
    assert r % blocks == 0 and tb.slots.shape == (s, length)
    per_rows, per_packed = s // blocks, r // blocks
    valid = tb.end > np.arange(t)[None]
    saved = 0
    for row in range(s):
        n = int(mask[row].sum())
        if n == 0:
            continue
        blk = row // per_rows
        flat = tb.slots[row, -n:]
        packed_row, slot = blk * per_packed + flat // t, flat % t
        assert (packed_row == packed_row[0]).all()  # one packed row of the row's own block holds it
        p = packed_row[0]
        np.testing.assert_array_equal(tb.tokens[p, slot], tokens[row, -n:])
        np.testing.assert_array_equal(tb.positions[p, slot], np.arange(n))
        for d in range(n):  # brute force: what the mask shows the token at depth d is its path
            i = slot[d]
            seen = {j for j in range(t) if valid[p, j] and j <= i < tb.end[p, j]}
            assert seen == set(slot[: d + 1].tolist())
    saved = int(mask.sum()) - int(valid.sum())
    assert saved > (0 if width > 40 else -1)  # shared tokens ran once


def _tree_logprobs(g, p, tb: TreeBatch):
    fn = jax.jit(T.tree_logprobs, static_argnums=(0, 7, 8, 9), compiler_options=FAST)
    arrays = (tb.tokens, tb.positions, tb.end, tb.slots, tb.targets)
    return [np.asarray(x) for x in fn(g, p, *map(jnp.asarray, arrays), tb.blocks, 8192, True)]


@pytest.mark.parametrize(
    "scan_layers,attention,width,blocks,window",
    [
        (False, "einsum", 64, 1, 10),
        (False, "einsum", 256, 2, 47),
        (True, "einsum", 128, 1, 10),
        (False, "xla", 64, 4, 10),
    ],
)
def test_tree_logprobs_equal_sequence_logprobs(scan_layers, attention, width, blocks, window):
    """attention "xla": the trees run the fused attention, the reference the plain einsum rows."""
    if scan_layers:  # the stacked layers, for both
        g_ref, p = init_params(ModelConfig.from_hf({**TINY, **INIT}, scan_layers=True), seed=0)
        g = g_ref
    else:
        g_ref, p = tiny_model(**INIT)
        g, p2 = init_params(ModelConfig.from_hf({**TINY, **INIT}, attention=attention), seed=0)
        assert jax.tree.structure(p2) == jax.tree.structure(p)
    b = _rows()
    order = token_order(b.tokens, b.attention_mask, np.arange(b.tokens.shape[0]))
    tokens, mask = b.tokens[order], b.attention_mask[order]
    tb = pack_tree(tokens, mask, width, window, blocks)
    assert (tb.end > np.arange(width)).sum() < mask.sum()  # the trees share: fewer real slots than tokens
    lp, ent = [
        np.asarray(x)
        for x in jax.jit(T.sequence_logprobs, static_argnums=(0, 4, 5, 6))(
            g_ref, p, jnp.asarray(tokens), jnp.asarray(mask), 8192, True, window
        )
    ]
    tlp, tent = _tree_logprobs(g, p, tb)
    assert tlp.shape == (tokens.shape[0], window + 1)
    # every column with a real predecessor: the loss tokens and all prompt tokens but the first
    w = np.zeros(mask.shape, bool)
    w[:, 1:] = mask[:, 1:] & mask[:, :-1]
    w[:, :-window] = False
    np.testing.assert_allclose(tlp[w[:, -window - 1 :]], lp[w], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(tent[w[:, -window - 1 :]], ent[w], atol=1e-5, rtol=1e-5)
    assert np.ptp(lp[w]) > 1.0  # the rows' log-probs differ: a wrong path or position would show


def test_decoder_refuses_a_bad_tree_end():
    g, p = tiny_model(**INIT)
    from flax import nnx

    model = nnx.merge(g, p)
    tokens = jnp.ones((2, 4), jnp.int32)
    pos = jnp.tile(jnp.arange(4), (2, 1))
    with pytest.raises(ValueError, match="tree_end: expected shape"):
        model(tokens, pos, jnp.ones((2, 4), bool), tree_end=jnp.ones((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="takes no cache"):
        model(
            tokens,
            pos,
            jnp.ones((2, 8), bool),
            cache=model.init_cache(2, 8),
            cache_index=0,
            tree_end=jnp.ones((2, 4), jnp.int32),
        )


@pytest.mark.parametrize(
    "mesh_shape,buckets", [(None, (16, 32, 48)), ({"data": 2, "fsdp": 4}, (16, 32, 48)), (None, (16, 32))]
)
def test_score_rows_as_trees_equals_plain(monkeypatch, mesh_shape, buckets):
    """score_rows with train.prefix_tree on (and one level of shared prefix off) and with neither: the
    same log-probs, the trees chosen for a chunk by model cost, and fewer tokens counted. Buckets
    (16, 32): some rows are longer than every bucket (the chunk's own width then)."""
    plans = []
    real_plan = rollout.scoring._chunk_plan

    def chunk_plan(*a):
        plans.append(real_plan(*a))
        return plans[-1]

    monkeypatch.setattr(rollout.scoring, "_chunk_plan", chunk_plan)
    g, p = tiny_model(**INIT)
    b = _rows()
    b = jax.tree.map(lambda x, y: np.concatenate([x, y]), b, _rows(seed=1))  # 32 rows
    mesh = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1]) if mesh_shape is None else sh.make_mesh(mesh_shape)

    def run(tree):
        # mini_batch_rows 4: one chunk of 4 rows per device as trees (32 on the 8-device mesh)
        train = types.SimpleNamespace(
            mini_batch_rows=4,
            length_buckets=buckets,
            logprob_chunk=8192,
            shared_prefix=False,
            prefix_tree=tree,
            bucket_steps=2,
        )
        return types.SimpleNamespace(
            config=types.SimpleNamespace(train=train),
            window=12,
            graphdef=g,
            pad_id=0,
            mesh=mesh,
            plan_model=ModelConfig.from_hf(TINY),
            work={"score": Work()},
        )

    args = (p, b.tokens, b.attention_mask, b.loss_mask)
    plain_run, tree_run = run(False), run(True)
    plain, tree = score_rows(plain_run, *args), score_rows(tree_run, *args)
    trees = [x for x in plans if isinstance(x, TreeBatch)]
    assert trees and all(x.blocks == (8 if mesh_shape else 1) for x in trees)
    if mesh_shape is None:  # (on the mesh each device's tree holds only 4 rows of one 32-row chunk)
        assert 0 < tree_run.work["score"].tokens < plain_run.work["score"].tokens
    assert sum(batch_work(x, 12)["tokens"] for x in trees) <= tree_run.work["score"].tokens
    assert np.ptp(plain[b.loss_mask]) > 1.0
    np.testing.assert_allclose(tree, plain, atol=1e-5, rtol=1e-5)


def test_plan_tree_weighs_attention():
    """The plan's width: the widest packs the most sharing, but a model whose attention dominates
    (a large pair weight) gets the narrowest that holds the longest row."""
    tokens, mask = _random_rows(2, n=48, length=40)
    wide = plan_tree(tokens, mask, (40, 80, 160, 320), 8, 1, pair=0.0)
    narrow = plan_tree(tokens, mask, (40, 80, 160, 320), 8, 1, pair=1.0)
    assert narrow.tokens.shape[1] == 40 and wide.tokens.shape[1] > 40
    assert wide.model_tokens < narrow.model_tokens
    with pytest.raises(ValueError, match="holds the longest row"):
        plan_tree(tokens, mask, (16, 32), 8, 1, pair=0.0)


@pytest.mark.parametrize("micro_batches,mesh_shape", [(1, None), (2, None), (2, {"data": 2, "fsdp": 4})])
def test_train_step_on_trees_equals_unshared(micro_batches, mesh_shape):
    """A train step on the mini-batch as prefix trees (TreeRows) gives the plain step's loss, metrics and
    parameters, with micro-batches and on an 8-device mesh (each device packs its own trees)."""
    _, p = tiny_model(**INIT)
    b = _rows()
    if mesh_shape is not None:  # 32 rows: 8 devices x 2 micro-batches of 2 rows
        b = jax.tree.map(lambda x, y: np.concatenate([x, y]), b, _rows(seed=1))
    one = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    mesh = one if mesh_shape is None else sh.make_mesh(mesh_shape)
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    tr, order = plan_tree_rows(b, (48, 96), 12, micro_batches, dp, pair=0.0)
    assert sorted(order.tolist()) == list(range(b.tokens.shape[0]))
    np.testing.assert_array_equal(tr.rows.loss_mask.sum(), b.loss_mask.sum())  # every loss token kept
    np.testing.assert_array_equal(tr.rows.row_index, b.row_index[order])
    assert tr.tree.blocks == dp and tr.tree.tokens.shape[0] % (micro_batches * dp) == 0
    if mesh_shape is None:
        assert (tr.tree.end > np.arange(tr.tree.tokens.shape[1])).sum() < b.attention_mask.sum()  # shared
    check_same_step(one, b, mesh, tr, micro_batches, p)


def test_step_refuses_trees_packed_for_another_layout():
    step, state = one_device_step()
    tr, _ = plan_tree_rows(_rows(), (48,), 12, 2, 1, pair=0.0)
    with pytest.raises(ValueError, match="packed for micro_batches=2 x 1 data-parallel blocks"):
        step(state, tr, 0.5)


@pytest.mark.parametrize(
    "tree,shared,want",
    [(False, False, "TokenBatch"), (True, False, "TreeRows"), (True, True, "cheaper"), (False, True, "SharedBatch")],
)
def test_update_batch_packs_trees_only_with_the_switch_on(tree, shared, want):
    """With a 7B model's weight of attention (pairs cheap) the trees beat the plain rows; with one
    level of shared prefix as well, the cheaper of the two plans runs."""
    from rollout.scoring import model_cost, update_batch
    from strata_jax.cost import MODELS

    def run(tree, shared):
        train = types.SimpleNamespace(
            micro_batches=2, length_buckets=(48,), shared_prefix=shared, prefix_tree_update=tree, bucket_steps=2
        )
        return types.SimpleNamespace(
            config=types.SimpleNamespace(train=train),
            plan_model=MODELS["qwen2.5-7b"],
            window=12,
            mesh=sh.make_mesh({"data": 2, "fsdp": 1}, devices=jax.devices()[:2]),
        )

    out = update_batch(run(tree, shared), _rows())
    if want != "cheaper":
        assert type(out).__name__ == want
        if want == "TreeRows":
            assert out.micro_batches == 2 and out.tree.blocks == 2
        return
    r = run(True, True)
    options = [update_batch(run(True, False), _rows()), update_batch(run(False, True), _rows())]
    assert {type(x).__name__ for x in options} == {"TreeRows", "SharedBatch"}
    assert model_cost(r, out) == min(model_cost(r, x) for x in options)
