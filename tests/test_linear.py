"""linear(): the value and both gradients equal those of jax.lax.dot_general (its own autodiff)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.models.linear import linear


@pytest.mark.parametrize("x_shape, w_shape, n_in", [
    ((2, 5, 8), (8, 32), 1),  # up projection: x is transposed for dW
    ((2, 5, 32), (32, 8), 1),  # down projection: dy is narrower, dy is transposed for dW
    ((3, 4, 6), (4, 6, 5), 2),  # o_proj-like: two input axes
    ((7, 16), (16, 4, 3), 1),  # k_proj-like: two output axes
])
def test_linear_matches_dot_general(x_shape, w_shape, n_in):
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=x_shape), jnp.float32)
    w = jnp.asarray(r.normal(size=w_shape), jnp.float32)
    nb = len(x_shape) - n_in
    dims = ((tuple(range(nb, len(x_shape))), tuple(range(n_in))), ((), ()))
    ref = lambda x, w: jax.lax.dot_general(x, w, dims)  # noqa: E731
    out_shape = ref(x, w).shape
    ct = jnp.asarray(r.normal(size=out_shape), jnp.float32)
    np.testing.assert_allclose(linear(x, w, n_in), ref(x, w), rtol=1e-6, atol=1e-6)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) * ct)  # noqa: E731
    gx, gw = jax.grad(loss(lambda x, w: linear(x, w, n_in)), argnums=(0, 1))(x, w)
    rx, rw = jax.grad(loss(ref), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, rw, rtol=1e-5, atol=1e-5)
    assert gw.shape == w.shape and gx.shape == x.shape

