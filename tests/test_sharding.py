"""Mesh construction, logical-axis rules and parameter placement on 8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from strata_jax import sharding as sh


class _Toy(nnx.Module):
    """Params annotated like the decoder's: embed/vocab/heads/kv_heads/head_dim, plus a bare bias."""

    def __init__(self):
        r = np.random.default_rng(0)  # numpy: eager jax.random would compile per op (slow CPU)
        self.embed = nnx.Param(
            jnp.asarray(r.normal(size=(64, 32)), jnp.float32), out_sharding=("vocab", "embed"), eager_sharding=False
        )
        self.q = nnx.Param(
            jnp.asarray(r.normal(size=(32, 4, 8)), jnp.float32),
            out_sharding=("embed", "heads", "head_dim"),
            eager_sharding=False,
        )
        self.k = nnx.Param(
            jnp.asarray(r.normal(size=(32, 2, 8)), jnp.float32),
            out_sharding=("embed", "kv_heads", "head_dim"),
            eager_sharding=False,
        )
        self.bias = nnx.Param(jnp.ones((32,)))


def test_make_mesh_shapes():
    m = sh.make_mesh({"fsdp": 2, "tensor": 4})
    assert m.axis_names == ("data", "fsdp", "tensor")
    assert dict(m.shape) == {"data": 1, "fsdp": 2, "tensor": 4}
    m = sh.make_mesh((2, -1, 1))
    assert dict(m.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    m = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    assert m.devices.size == 1


@pytest.mark.parametrize(
    "shape,msg",
    [
        ({"fsdp": 3}, "needs 3 devices"),
        ({"model": 2}, "unknown mesh axis"),
        ((2, 4), "3 entries"),
        ((-1, -1, 2), "invalid shape"),
    ],
)
def test_make_mesh_bad(shape, msg):
    with pytest.raises(sh.ShardingError, match=msg):
        sh.make_mesh(shape)


def test_logical_to_spec_rules_and_divisibility():
    mesh = sh.make_mesh({"fsdp": 2, "tensor": 4})
    r = sh.DEFAULT_RULES
    assert sh.logical_to_spec(("embed", "heads", "head_dim"), r, mesh, (32, 4, 8)) == P("fsdp", "tensor", None)
    # 2 kv heads on a tensor axis of 4: replicated over 'tensor' instead of failing.
    assert sh.logical_to_spec(("embed", "kv_heads", "head_dim"), r, mesh, (32, 2, 8)) == P("fsdp", None, None)
    # a mesh axis is used at most once per spec
    assert sh.logical_to_spec(("vocab", "mlp"), r, mesh, (64, 64)) == P("tensor", None)
    # multi-axis rule keeps the axes that divide, in order
    mesh2 = sh.make_mesh({"data": 2, "fsdp": 4})
    assert sh.logical_to_spec(("batch",), r, mesh2, (8,)) == P(("data", "fsdp"))
    assert sh.logical_to_spec(("batch",), r, mesh2, (2,)) == P("data")
    assert sh.logical_to_spec(None, r, mesh) == P()


def test_logical_to_spec_errors():
    mesh = sh.make_mesh({"fsdp": 2, "tensor": 4})
    with pytest.raises(sh.ShardingError, match="'embd' has no rule"):
        sh.logical_to_spec(("embd",), sh.DEFAULT_RULES, mesh, (4,))
    with pytest.raises(sh.ShardingError, match="rank"):
        sh.logical_to_spec(("embed", "vocab"), sh.DEFAULT_RULES, mesh, (4,))
    with pytest.raises(sh.ShardingError, match="not an axis of the mesh"):
        sh.logical_to_spec(("embed",), {"embed": "model"}, mesh, (4,))


def test_param_shardings_and_shard_params():
    mesh = sh.make_mesh({"fsdp": 2, "tensor": 4})
    _, params = nnx.split(_Toy())
    shard = sh.param_shardings(params, mesh, sh.DEFAULT_RULES)
    assert shard["embed"].get_value().spec == P("tensor", "fsdp")
    assert shard["q"].get_value().spec == P("fsdp", "tensor", None)
    assert shard["k"].get_value().spec == P("fsdp", None, None)
    assert shard["bias"].get_value().spec == P()
    placed = sh.shard_params(params, mesh, sh.DEFAULT_RULES)
    q = placed["q"].get_value()
    assert q.sharding.spec == P("fsdp", "tensor", None)
    # each device holds a [16, 1, 8] block; values unchanged
    assert {s.data.shape for s in q.addressable_shards} == {(16, 1, 8)}
    np.testing.assert_array_equal(np.asarray(q), np.asarray(params["q"].get_value()))


def test_param_shardings_on_abstract_tree_and_optax_state():
    import optax

    mesh = sh.make_mesh({"fsdp": 2, "tensor": 4})
    _, params = nnx.split(_Toy())
    abstract = jax.eval_shape(lambda p: p, params)
    assert sh.param_shardings(abstract, mesh)["q"].get_value().spec == P("fsdp", "tensor", None)
    opt = jax.eval_shape(optax.adamw(1e-3).init, params)
    s = sh.param_shardings(opt, mesh)
    assert s[0].mu["q"].get_value().spec == P("fsdp", "tensor", None)
    assert s[0].count.spec == P()


def test_data_sharding_splits_batch():
    mesh = sh.make_mesh({"data": 2, "fsdp": 4})
    x = jax.device_put(jnp.arange(16 * 3).reshape(16, 3), sh.data_sharding(mesh))
    assert {s.data.shape for s in x.addressable_shards} == {(2, 3)}


def test_host_local_to_global_single_process():
    mesh = sh.make_mesh({"data": 2, "fsdp": 4})
    x = np.arange(16 * 3).reshape(16, 3)
    out = sh.host_local_to_global({"x": x}, mesh)["x"]
    assert out.sharding == sh.data_sharding(mesh)
    np.testing.assert_array_equal(np.asarray(out), x)


def test_mesh_config_section():
    """A whole `config.mesh` section (ConfigDict with `distributed`) works for both calls."""
    import ml_collections

    c = ml_collections.ConfigDict(dict(data=2, fsdp=-1, tensor=2, distributed=False))
    assert dict(sh.make_mesh(c).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert sh.maybe_init_distributed(c) is False


def test_maybe_init_distributed_disabled_and_bad_key():
    assert sh.maybe_init_distributed(None) is False
    assert sh.maybe_init_distributed({"enabled": False}) is False
    with pytest.raises(sh.ShardingError, match="coordinator"):
        sh.maybe_init_distributed({"enabled": True, "coordinator": "x"})
