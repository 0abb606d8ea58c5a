"""Checkpointer: round trip onto other meshes, retention, JSON progress, named mismatch errors."""

import jax
import numpy as np
import pytest

from strata_jax import sharding as sh
from strata_jax import train as T
from strata_jax.checkpoint import Checkpointer, CheckpointMismatchError
from strata_jax.models.config import ModelConfig
from strata_jax.models.qwen2 import Decoder
from tests.test_train import TINY, tiny_model, to_numpy


def _abstract_params(**overrides):
    """Shapes only (nothing allocated): what a resuming run builds its restore target from."""
    from flax import nnx

    cfg = ModelConfig.from_hf({**TINY, **overrides})
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))[1]


def _state(mesh, seed=0, **overrides):
    g, p = tiny_model(seed, **overrides)
    opt = T.make_optimizer()
    return T.init_train_state(g, p, opt, seed, mesh), p, opt


def test_round_trip_across_meshes(tmp_path):
    mesh8 = sh.make_mesh({"fsdp": 2, "tensor": 4})
    state, _, opt = _state(mesh8, seed=1)
    # make the optimiser state non-trivial so a wrong leaf mapping would show
    state = jax.jit(
        lambda s: s.replace(
            opt_state=jax.tree.map(lambda x: x + x.dtype.type(3), s.opt_state), step=s.step + 7, skipped=s.skipped + 2
        )
    )(state)
    extra = {"iteration": 7, "data_position": [3, 1], "rollout_rng": [1, 2], "history": [{"loss": 0.5}]}
    with Checkpointer(tmp_path, save_every=1, keep=2, async_save=True) as ckpt:
        assert ckpt.save(7, state, extra)
    saved = to_numpy(state)

    ckpt = Checkpointer(tmp_path)  # a fresh manager, as after a restart
    assert ckpt.latest_step() == 7
    for mesh in (sh.make_mesh((1, 1, 1), devices=jax.devices()[:1]), sh.make_mesh({"data": 2, "fsdp": 4})):
        target = T.abstract_train_state(_abstract_params(), opt, mesh)
        restored, got_extra = ckpt.restore_latest(target)
        assert got_extra == extra
        for a, b in zip(saved, to_numpy(restored)):
            np.testing.assert_array_equal(a, b)
        q = restored.params["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
        assert q.sharding == target.params["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value().sharding
        assert jax.tree.structure(restored) == jax.tree.structure(target)
    ckpt.close()


def test_explicit_shardings_argument(tmp_path):
    mesh = sh.make_mesh({"fsdp": 8})
    state, p, opt = _state(mesh)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state)
        concrete_target, _, _ = _state(sh.make_mesh((1, 1, 1), devices=jax.devices()[:1]), seed=3)
        shardings = T.train_state_shardings(concrete_target, mesh)
        restored, extra = ckpt.restore(1, concrete_target, shardings)
    assert extra == {}
    assert (
        restored.params["embed_tokens"]["embedding"].get_value().sharding.spec
        == shardings.params["embed_tokens"]["embedding"].get_value().spec
    )
    for a, b in zip(to_numpy(state), to_numpy(restored)):
        np.testing.assert_array_equal(a, b)


def test_save_every_and_keep(tmp_path):
    tree = {"w": np.arange(3.0)}
    with Checkpointer(tmp_path, save_every=2, keep=2, async_save=False) as ckpt:
        assert ckpt.restore_latest(tree) is None and ckpt.latest_step() is None
        saved = [s for s in range(7) if ckpt.save(s, {"w": np.arange(3.0) + s})]
        assert saved == [0, 2, 4, 6]
        assert ckpt.save(7, tree, force=True)
        assert ckpt.all_steps() == [6, 7]
        w, _ = ckpt.restore(6, tree)
        np.testing.assert_array_equal(np.asarray(w["w"]), np.arange(3.0) + 6)


def test_other_model_shape_fails_with_named_path(tmp_path):
    mesh = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    state, _, opt = _state(mesh)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(0, state)
    ckpt = Checkpointer(tmp_path)
    wide = _abstract_params(intermediate_size=96)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"params/layers/0/mlp/down_proj/kernel/value: checkpoint shape \(64, 32\) "
        r"!= model shape \(96, 32\)",
    ):
        ckpt.restore_latest(T.abstract_train_state(wide, opt, mesh))
    deep = _abstract_params(num_hidden_layers=3)
    with pytest.raises(CheckpointMismatchError, match=r"checkpoint has no parameter .*layers/2/"):
        ckpt.restore_latest(T.abstract_train_state(deep, opt, mesh))
    shallow = _abstract_params(num_hidden_layers=1)
    with pytest.raises(CheckpointMismatchError, match=r"checkpoint has parameter .*layers/1/.* that the model lacks"):
        ckpt.restore_latest(T.abstract_train_state(shallow, opt, mesh))
    ckpt.close()


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="save_every must be >= 1"):
        Checkpointer(tmp_path, save_every=0)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        with pytest.raises(TypeError, match="JSON-serialisable"):
            ckpt.save(0, {"w": np.zeros(2)}, extra={"x": object()})
        with pytest.raises(TypeError, match="typed PRNG key"):
            ckpt.save(0, {"rng": jax.random.key(0)})
