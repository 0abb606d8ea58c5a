"""linear(): the value and both gradients equal those of jax.lax.dot_general (its own autodiff)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.models.linear import linear


@pytest.mark.parametrize(
    "x_shape, w_shape, n_in",
    [
        ((2, 5, 8), (8, 32), 1),  # up projection: x is transposed for dW
        ((2, 5, 32), (32, 8), 1),  # down projection: dy is narrower, dy is transposed for dW
        ((3, 4, 6), (4, 6, 5), 2),  # o_proj-like: two input axes
        ((7, 16), (16, 4, 3), 1),  # k_proj-like: two output axes
    ],
)
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


def test_bf16_inputs_with_f32_output():
    """out_dtype=f32 on bf16 operands: the value is the f32 product of the bf16 values (exact
    products, f32 sums), and the gradients are the bf16-rounded incoming gradient's products."""
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(3, 5, 16)), jnp.bfloat16)
    w = jnp.asarray(r.normal(size=(16, 24)), jnp.bfloat16)
    ct = jnp.asarray(r.normal(size=(3, 5, 24)), jnp.float32)
    y = linear(x, w, 1, jnp.float32)
    assert y.dtype == jnp.float32
    x32, w32 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(y), x32 @ w32, rtol=1e-6, atol=1e-5)
    gx, gw = jax.grad(lambda x, w: jnp.sum(linear(x, w, 1, jnp.float32) * ct), argnums=(0, 1))(x, w)
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    ct16 = np.asarray(ct.astype(jnp.bfloat16), np.float64)
    np.testing.assert_allclose(np.asarray(gx, np.float64), ct16 @ w32.T, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(gw, np.float64), np.einsum("btd,btv->dv", x32, ct16), rtol=1e-2, atol=5e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_logprobs_against_full_log_softmax(dtype):
    """Chunked head (vocab 50 in chunks of 16, so the last chunk is padded) against a plain
    float64 log-softmax of the same products: hidden and kernel rounded to the compute dtype,
    as the sampler's head sees them."""
    from strata_jax.models.heads import token_logprobs

    r = np.random.default_rng(2)
    h = jnp.asarray(r.normal(size=(2, 7, 12)), dtype)
    w = jnp.asarray(r.normal(size=(12, 50)) * 0.5, jnp.float32)  # f32 master weights
    tgt = jnp.asarray(r.integers(0, 50, size=(2, 7)), jnp.int32)
    logp, ent = token_logprobs(h, w, tgt, chunk_size=16, return_entropy=True)
    assert logp.dtype == jnp.float32
    logits = np.asarray(h, np.float64) @ np.asarray(w.astype(dtype), np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ref = np.take_along_axis(logits, np.asarray(tgt)[..., None], -1)[..., 0] - lse
    p = np.exp(logits - lse[..., None])
    np.testing.assert_allclose(np.asarray(logp), ref, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent), -(p * np.log(p)).sum(-1), atol=2e-5)


@pytest.mark.parametrize("entropy", [False, True])
def test_token_logprobs_gradients_against_autodiff_of_full_softmax(entropy):
    """The head's hand-written backward (heads._lse_mean) against jax's autodiff of a plain
    [B, T, V] log-softmax in float64: both gradients, with a padded last chunk and tied targets."""
    from strata_jax.models.heads import token_logprobs

    jax.config.update("jax_enable_x64", True)
    try:
        r = np.random.default_rng(3)
        h = r.normal(size=(2, 5, 12))
        w = r.normal(size=(12, 50)) * 0.7
        tgt = jnp.asarray(r.integers(0, 50, size=(2, 5)), jnp.int32)
        a, b = r.normal(size=(2, 5)), r.normal(size=(2, 5))

        def ours(h, w):
            logp, ent = token_logprobs(h, w, tgt, chunk_size=16, return_entropy=entropy)
            return (logp * a).sum() + ((ent * b).sum() if entropy else 0.0)

        def plain(h, w):
            logsm = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, w), axis=-1)
            logp = jnp.take_along_axis(logsm, tgt[..., None], -1)[..., 0]
            ent = -(jnp.exp(logsm) * logsm).sum(-1)
            return (logp * a).sum() + ((ent * b).sum() if entropy else 0.0)

        h32, w32 = jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32)
        v, (gh, gw) = jax.value_and_grad(ours, argnums=(0, 1))(h32, w32)
        rv, (rgh, rgw) = jax.value_and_grad(plain, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(w))
        assert gh.dtype == jnp.float32 and gw.dtype == jnp.float32
        np.testing.assert_allclose(float(v), float(rv), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(gh), np.asarray(rgh), atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(gw), np.asarray(rgw), atol=2e-5, rtol=1e-4)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_token_logprobs_bf16_gradients_round_like_the_products():
    """A bf16 model: the gradients follow the float32 ones to bf16's precision, in bf16 (hidden)
    and float32 (master kernel)."""
    from strata_jax.models.heads import token_logprobs

    r = np.random.default_rng(4)
    h = r.normal(size=(2, 6, 16))
    w = r.normal(size=(16, 40)) * 0.5
    tgt = jnp.asarray(r.integers(0, 40, size=(2, 6)), jnp.int32)

    def f(h, w):
        logp, ent = token_logprobs(h, w, tgt, chunk_size=16, return_entropy=True)
        return logp.sum() + 0.3 * ent.sum()

    gh16, gw16 = jax.grad(f, argnums=(0, 1))(jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.float32))
    gh32, gw32 = jax.grad(f, argnums=(0, 1))(
        jnp.asarray(h, jnp.bfloat16).astype(jnp.float32), jnp.asarray(w, jnp.bfloat16).astype(jnp.float32)
    )
    assert gh16.dtype == jnp.bfloat16 and gw16.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(gh16, np.float32), np.asarray(gh32), atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(np.asarray(gw16), np.asarray(gw32), atol=3e-2, rtol=3e-2)
