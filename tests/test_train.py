"""Train step: log-probs vs full logits, micro-batch accumulation, sharding, NaN skip, exact resume."""

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from strata_jax import sharding as sh
from strata_jax import train as T
from strata_jax.batch import TokenBatch
from strata_jax.loss import LossConfig, policy_loss
from strata_jax.models.config import ModelConfig
from strata_jax.models.qwen2 import Decoder

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(
    model_type="qwen2",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
LOSS = LossConfig(kl_coef=0.05, entropy_bonus=True, entropy_coef=0.01)
# Low XLA optimisation level: compiles ~3x faster on the shared CPU; every comparison below
# compiles both sides with the same options.
FAST = {"xla_backend_optimization_level": 0}
_STEPS = {}
_INITS = {}
# AdamW with eps above the fp32 noise of near-zero gradient entries: with eps = 1e-8 an entry of
# ~1e-8 whose value differs by 5% between reduction orders moves its update by ~1% of lr, which
# would hide a real sharding error's size. A wrong gradient still moves params by O(lr).
OPT = dict(lr=1e-3, eps=1e-3)


def tiny_model(seed=0, **overrides):
    """(graphdef, params) of a 2-layer, hidden-32, vocab-64 Qwen2 decoder.

    Initialised in one jitted call: eager init compiles every random op separately (slow on
    the shared CPU).
    """
    cfg = ModelConfig.from_hf({**TINY, **overrides})
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    key = tuple(sorted(overrides.items()))
    if key not in _INITS:
        _INITS[key] = jax.jit(lambda k: nnx.split(Decoder(cfg, rngs=nnx.Rngs(params=k)))[1], compiler_options=FAST)
    return graphdef, _INITS[key](jax.random.key(seed))


def random_batch(seed, S=16, L=12, vocab=64) -> TokenBatch:
    """Left-padded prompts + responses; a quarter strategy rows, last row padding (host numpy)."""
    r = np.random.default_rng(seed)
    tokens = r.integers(0, vocab, (S, L)).astype(np.int32)
    pad = r.integers(0, 4, S)
    col = np.arange(L)[None]
    attn = col >= pad[:, None]
    resp = col >= pad[:, None] + r.integers(2, 6, S)[:, None]
    loss_mask = attn & resp & (r.random((S, L)) < 0.9)
    row_index = np.zeros((S, 4), np.int32)
    row_index[:, 3] = np.where(np.arange(S) % 4 == 1, -1, np.arange(S))
    valid = np.ones(S, bool)
    valid[-1] = False
    adv = np.repeat(r.normal(size=(S, 1)), L, 1).astype(np.float32)
    old = (-np.log(vocab) + r.normal(0, 0.3, (S, L))).astype(np.float32)
    ref = (-np.log(vocab) + r.normal(0, 0.3, (S, L))).astype(np.float32)
    z = lambda x: np.where(loss_mask, x, 0.0).astype(np.float32)  # noqa: E731
    return TokenBatch(
        tokens=tokens,
        attention_mask=attn,
        loss_mask=loss_mask & valid[:, None],
        old_logp=z(old),
        ref_logp=z(ref),
        advantage=z(adv),
        row_index=row_index,
        row_valid=valid,
    )


def to_numpy(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def cached_step(mesh, micro_batches):
    """One TrainStep per (mesh, micro_batches): each new jax.jit would compile again."""
    key = (tuple(mesh.shape.items()), micro_batches)
    if key not in _STEPS:
        g, _ = tiny_model()
        opt = T.make_optimizer(OPT)
        _STEPS[key] = (
            opt,
            T.make_train_step(g, opt, LOSS, mesh, sh.DEFAULT_RULES, micro_batches, compiler_options=FAST),
        )
    return _STEPS[key]


def run_steps(mesh, batches, micro_batches=1, params=None):
    g, p = tiny_model()
    opt, step = cached_step(mesh, micro_batches)
    state = T.init_train_state(g, p if params is None else params, opt, 0, mesh, sh.DEFAULT_RULES)
    metrics = []
    for b in batches:
        state, m = step(state, b, 0.5)
        metrics.append({k: float(v) for k, v in m.items()})
    return state, metrics


def one_device():
    return sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])


# ----------------------------------------------------------------------------------------------


def test_sequence_logprobs_match_full_softmax():
    """Chunked head + shift vs numpy log_softmax of the model's full logits."""
    g, p = tiny_model()
    b = random_batch(0)
    logp, ent = jax.jit(T.sequence_logprobs, static_argnums=(0, 4, 5), compiler_options=FAST)(
        g, p, jnp.asarray(b.tokens), jnp.asarray(b.attention_mask), 24, True
    )

    @jax.jit
    def full_logits(params, tokens, mask):
        model = nnx.merge(g, params)
        hidden, _ = model(tokens, jnp.maximum(jnp.cumsum(mask, 1) - 1, 0), mask)
        return model.logits(hidden)

    logits = np.asarray(full_logits(p, b.tokens, b.attention_mask), np.float64)  # [S, L, V]
    lsm = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    want = np.zeros(b.tokens.shape)
    want_ent = np.zeros(b.tokens.shape)
    for s in range(b.tokens.shape[0]):
        for i in range(1, b.tokens.shape[1]):
            want[s, i] = lsm[s, i - 1, b.tokens[s, i]]
            want_ent[s, i] = -(np.exp(lsm[s, i - 1]) * lsm[s, i - 1]).sum()
    np.testing.assert_allclose(np.asarray(logp), want, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent), want_ent, atol=2e-5)
    pos = np.asarray(T.positions_from_mask(jnp.asarray(b.attention_mask)))  # as the contract states
    np.testing.assert_array_equal(pos, np.maximum(np.cumsum(b.attention_mask, 1) - 1, 0))


def test_four_microbatches_equal_one_full_batch():
    """4 micro-batches (scan, sums / counts) == a plain full-batch grad + the same optax step (fp32)."""
    b = random_batch(1)
    g, p = tiny_model()
    opt, _ = cached_step(one_device(), 4)

    def full_loss(params):
        logp, ent = T.sequence_logprobs(
            g, params, jnp.asarray(b.tokens), jnp.asarray(b.attention_mask), return_entropy=True
        )
        s, c, _ = policy_loss(logp, jax.tree.map(jnp.asarray, b), LOSS, 0.5, ent)
        return s / c

    @jax.jit
    def reference(params):
        loss, grads = jax.value_and_grad(full_loss)(params)
        upd, _ = opt.update(grads, opt.init(params), params)
        return optax.apply_updates(params, upd), loss, optax.tree.norm(grads)

    new_p, loss, gnorm = reference(p)
    want, base = to_numpy(new_p), to_numpy(p)
    state, m = run_steps(one_device(), [b], micro_batches=4)
    assert max(np.abs(w - b0).max() for w, b0 in zip(want, base)) > 1e-4  # the update is real
    for w, x in zip(want, to_numpy(state.params)):
        np.testing.assert_allclose(x, w, atol=1e-6, rtol=0)
    np.testing.assert_allclose(m[0]["loss"], float(loss), rtol=1e-5)
    np.testing.assert_allclose(m[0]["grad_norm"], float(gnorm), rtol=1e-5)
    assert m[0]["tokens"] == b.loss_mask.sum()


@pytest.mark.parametrize("shape", [{"fsdp": 2, "tensor": 4}, {"data": 2, "fsdp": 4}])
def test_sharded_equals_single_device(shape):
    batches = [random_batch(i) for i in range(3)]
    ref, ref_m = run_steps(one_device(), batches, micro_batches=2)
    mesh = sh.make_mesh(shape)
    state, m = run_steps(mesh, batches, micro_batches=2)
    # really sharded: a [D, H, Dh] kernel is split over fsdp (and tensor when present)
    q = state.params["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
    assert len({str(s.index) for s in q.addressable_shards}) > 1
    mu = state.opt_state[1][0].mu["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
    assert mu.sharding.spec == q.sharding.spec  # optimiser state sharded like its param
    for a, b in zip(to_numpy(ref.params), to_numpy(state.params)):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=0)
    for k in ("loss", "grad_norm", "kl", "entropy"):
        np.testing.assert_allclose(m[-1][k], ref_m[-1][k], rtol=1e-5)


def test_nan_advantage_skips_update():
    mesh = one_device()
    g, p = tiny_model()
    opt, step = cached_step(mesh, 2)
    state = T.init_train_state(g, p, opt, 0, mesh)
    good = random_batch(2)
    bad_adv = good.advantage.copy()
    s, i = np.argwhere(good.loss_mask)[0]
    bad_adv[s, i] = np.nan
    bad = good.replace(advantage=bad_adv)
    before_p, before_o = to_numpy(state.params), to_numpy(state.opt_state)
    state, m = step(state, bad, 0.5)
    assert m["skipped"] == 1 and m["applied"] == 0 and not np.isfinite(float(m["loss"]))
    for a, b in zip(before_p + before_o, to_numpy(state.params) + to_numpy(state.opt_state)):
        np.testing.assert_array_equal(a, b)
    assert int(state.step) == 1 and int(state.skipped) == 1
    state, m = step(state, good, 0.5)  # recovers
    assert m["applied"] == 1 and m["skipped"] == 1
    assert any(np.abs(a - b).max() > 0 for a, b in zip(before_p, to_numpy(state.params)))


def test_batch_without_loss_tokens_is_not_applied():
    b = random_batch(3)
    b = b.replace(loss_mask=np.zeros_like(b.loss_mask))
    g, p = tiny_model()
    state, m = run_steps(one_device(), [b], micro_batches=2, params=p)
    assert m[0]["applied"] == 0 and m[0]["skipped"] == 0 and m[0]["tokens"] == 0
    for a, c in zip(to_numpy(p), to_numpy(state.params)):
        np.testing.assert_array_equal(a, c)


def test_bad_batch_shape_raises():
    g, p = tiny_model()
    mesh = sh.make_mesh({"data": 2, "fsdp": 4})
    opt = T.make_optimizer()
    state = T.init_train_state(g, p, opt, 0, mesh)
    step = T.make_train_step(g, opt, LOSS, mesh, micro_batches=4)
    with pytest.raises(ValueError, match=r"S=12 must be divisible by micro_batches=4 x data-parallel devices=8"):
        step(state, random_batch(0, S=12), 0.5)


def test_optimizer_schedule_and_clip():
    cfg = T.OptimizerConfig(lr=1e-3, schedule="warmup_cosine", warmup_steps=10)
    sched = T.make_schedule(cfg, total_steps=110)
    assert float(sched(0)) == 0.0
    np.testing.assert_allclose(float(sched(5)), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(float(sched(60)), 1e-3 * 0.5 * (1 + np.cos(np.pi * 0.5)), rtol=1e-5)
    np.testing.assert_allclose(float(T.make_schedule(T.OptimizerConfig(lr=1e-3, warmup_steps=4))(2)), 5e-4)
    with pytest.raises(ValueError, match="needs total_steps"):
        T.make_optimizer(cfg)
    with pytest.raises(ValueError, match="schedule 'linear' is unknown"):
        T.make_optimizer(dict(schedule="linear"))
    # clip 1.0: a gradient of norm 100 gives SGD-like moments of the clipped gradient (norm 1)
    opt = T.make_optimizer(dict(lr=1.0, weight_decay=0.0))
    p = {"w": jnp.zeros(4)}
    _, st = opt.update({"w": jnp.full(4, 50.0)}, opt.init(p), p)
    np.testing.assert_allclose(np.asarray(st[1][0].mu["w"]), 0.1 * 0.5, rtol=1e-6)  # (1 - b1) * 0.5
    assert T.optimizer_config({"lr": 2e-6, "eps_low": 0.2}).lr == 2e-6  # a whole train section is fine


def test_minibatches_cover_each_row_once():
    b = random_batch(4, S=10)
    seen = []
    parts = list(T.minibatches(b, rows=4, seed=0))
    assert len(parts) == 3 and all(x.tokens.shape == (4, 12) for x in parts)
    for x in parts:
        for s in range(4):
            if x.row_valid[s] or x.attention_mask[s].any():
                seen.append(x.tokens[s].tobytes())
    assert sorted(seen) == sorted(b.tokens[s].tobytes() for s in range(10))
    last_rows = np.random.default_rng(0).permutation(10)[8:]
    assert parts[-1].row_valid.sum() == b.row_valid[np.isin(np.arange(10), last_rows)].sum()
    assert not parts[-1].loss_mask[2:].any()  # the 2 padding rows train nothing


# ----------------------------------------------------------------------------------------------
# Exact resume across processes

_RESUME_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, jax
    sys.path.insert(0, {repo!r})
    from tests.test_train import tiny_model, random_batch, LOSS, OPT, to_numpy
    from strata_jax import train as T, sharding as sh
    from strata_jax.checkpoint import Checkpointer
    mesh = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    g, p = tiny_model(seed=123)  # different init: everything must come from the checkpoint
    opt = T.make_optimizer(OPT)
    target = T.abstract_train_state(p, opt, mesh)
    ckpt = Checkpointer({ckpt!r}, async_save=False)
    state, extra = ckpt.restore_latest(target)
    step = T.make_train_step(g, opt, LOSS, mesh, sh.DEFAULT_RULES, micro_batches=2,
                             compiler_options={{"xla_backend_optimization_level": 0}})
    for i in range(extra["next_batch"], 4):
        state, m = step(state, random_batch(10 + i), extra["lam"])
    np.savez({out!r}, *to_numpy(state))
""")


def test_resume_in_new_process_is_bit_exact(tmp_path):
    from strata_jax.checkpoint import Checkpointer

    mesh = one_device()
    batches = [random_batch(10 + i) for i in range(4)]
    straight, _ = run_steps(mesh, batches, micro_batches=2)
    straight = to_numpy(straight)

    half, _ = run_steps(mesh, batches[:2], micro_batches=2)
    ckpt = Checkpointer(tmp_path / "ckpt", save_every=1, keep=2, async_save=True)
    assert ckpt.save(2, half, extra={"next_batch": 2, "lam": 0.5, "history": [{"loss": 0.1}]})
    ckpt.close()
    out = tmp_path / "resumed.npz"
    script = _RESUME_SCRIPT.format(repo=str(REPO), ckpt=str(tmp_path / "ckpt"), out=str(out))
    env = dict(os.environ)
    res = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = np.load(out)
    resumed = [resumed[f"arr_{i}"] for i in range(len(resumed.files))]
    assert len(resumed) == len(straight)
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a, b)
    assert int(resumed[-3]) == 4  # TrainState leaves end with step, rng, skipped
