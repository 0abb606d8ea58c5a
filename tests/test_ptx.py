"""PPO-ptx steps (`train.ptx_coef`) and type-stratified task sets (`algo.task_sampling`).

The ptx step is checked against a hand-written reference: the gradient of coef x the mean
response-token NLL (the SFT loss), through the same optax optimiser, applied once.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs.base import ConfigError, validate
from configs.tiny_household import get_config
from rollout.envs.household import HouseholdEnv
from rollout.envs.household_world import reachable_types, task_type_of
from rollout.setup import train_tasks
from strata_jax import sft
from strata_jax import sharding as sh
from strata_jax import train as T
from strata_jax.batch import pad_token_rows
from strata_jax.models.config import ModelConfig
from strata_jax.models.qwen2 import Decoder

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


def _demo_rows(n=8, length=16, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, V, rng.integers(3, 9)).astype(np.int32) for _ in range(n)]
    resps = [rng.integers(1, V, rng.integers(1, 6)).astype(np.int32) for _ in range(n)]
    return pad_token_rows(prompts, resps, [np.zeros(len(r), np.float32) for r in resps], length, n, pad_id=0)


def _reference_nll(graphdef, params, pk):
    """Mean NLL of the response tokens from the full logits, written out (no shared helper)."""
    m = nnx.merge(graphdef, params)
    tok, att = jnp.asarray(pk["tokens"]), jnp.asarray(pk["attention_mask"])
    pos = jnp.maximum(jnp.cumsum(att, axis=1) - 1, 0)
    hidden, _ = m(tok, pos, att)
    logits = hidden[:, :-1] @ m.unembed_kernel()
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tok[:, 1:, None], -1)[..., 0]
    w = jnp.asarray(pk["loss_mask"])[:, 1:].astype(jnp.float32)
    return -(lp * w).sum() / w.sum()


@pytest.mark.parametrize("coef", [0.5, 0.0])
def test_ptx_step_is_coef_times_the_sft_gradient_through_the_run_optimizer(model, coef):
    graphdef, params = model
    mesh = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    opt = T.make_optimizer({"lr": 1e-2, "eps": 1e-3, "grad_clip": 1.0, "weight_decay": 0.01})
    state = T.init_train_state(graphdef, jax.tree.map(jnp.copy, params), opt, 0, mesh)
    pk = _demo_rows()

    # reference: one optax step on coef x grad(mean NLL)
    loss_ref, g = jax.value_and_grad(lambda p: _reference_nll(graphdef, p, pk))(params)
    upd, _ = opt.update(jax.tree.map(lambda x: coef * x, g), opt.init(params), params)
    want = optax.apply_updates(params, upd) if coef > 0 else params

    step = sft.make_ptx_step(graphdef, opt, mesh)
    new, nll = step(state, pk["tokens"], pk["attention_mask"], pk["loss_mask"], coef)
    np.testing.assert_allclose(float(nll), float(loss_ref), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
    assert int(new.step) == 0 and int(new.skipped) == 0  # the policy update's counters are untouched
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(params)))
    assert (moved > 1e-4) == (coef > 0)


def test_ptx_steps_lower_the_demonstrations_nll(model):
    graphdef, params = model
    mesh = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    opt = T.make_optimizer({"lr": 3e-2})
    state = T.init_train_state(graphdef, jax.tree.map(jnp.copy, params), opt, 0, mesh)
    pk = _demo_rows(seed=3)
    step = sft.make_ptx_step(graphdef, opt, mesh)
    losses = []
    for _ in range(12):
        state, nll = step(state, pk["tokens"], pk["attention_mask"], pk["loss_mask"], 1.0)
        losses.append(float(nll))
    assert losses[-1] < 0.7 * losses[0], losses


def test_by_type_task_sets_cycle_through_every_reachable_type():
    c = get_config()
    c.algo.task_sampling = "by_type"
    lo, hi = c.env.horizon_min, c.env.horizon_max
    types = reachable_types(lo, hi)
    assert len(types) == 6  # the default's horizons reach every ALFWorld type
    seen = collections.Counter()
    for it in range(1, 4):  # 3 iterations x 4 tasks = 12 = every type twice
        seeds = train_tasks(c, it, None)
        assert len(set(seeds)) == len(seeds) == c.algo.tasks_per_iter
        assert all(0 <= s < c.env.eval_seed_offset for s in seeds)  # training seeds only
        assert train_tasks(c, it, None) == seeds  # a pure function of (seed, iteration)
        for s in seeds:
            env = HouseholdEnv(horizon=(lo, hi))
            env.reset(seed=s)  # the type the environment really draws, not the helper's word
            assert env.task.task_type == task_type_of(s, lo, hi)
            seen[env.task.task_type] += 1
    assert seen == {t: 2 for t in types}


def test_reachable_types_follow_the_horizon():
    assert reachable_types(2, 2) == ("look_at_obj_in_light",)  # take, use
    assert "pick_two" not in reachable_types(2, 5)
    assert "pick_two" in reachable_types(2, 12)


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("train.ptx_coef", -1.0, "ptx_coef=-1.0 must be >= 0"),
        ("train.ptx_rows", 0, "ptx_rows=0"),
        ("train.rl_update", False, "rl_update=False leaves the update nothing to do"),
    ],
)
def test_bad_ptx_settings_name_the_key(key, value, fragment):
    c = get_config()
    sec, name = key.split(".")
    c[sec][name] = value
    with pytest.raises(ConfigError, match=fragment):
        validate(c)


def test_ptx_and_by_type_are_refused_where_not_wired():
    from configs.base import base_config, with_algo_env

    c = with_algo_env(base_config(), "grpo", "alfworld")
    c.train.ptx_coef = 1.0
    with pytest.raises(ConfigError, match="needs demonstrations"):
        validate(c)
    c.sft.demos = "demos.jsonl"
    validate(c)  # a JSONL of demonstrations is enough
    c.algo.task_sampling = "by_type"
    with pytest.raises(ConfigError, match="by_type' is only wired for env.name='household'"):
        validate(c)
