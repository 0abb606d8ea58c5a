"""Policy loss vs an independent float64 numpy computation (ratio space, explicit per-row loops)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.batch import TokenBatch
from strata_jax.loss import (
    LossConfig,
    combine_metrics,
    config_from_dict,
    empty_metrics,
    finalize_metrics,
    policy_loss,
    row_weights,
)

S, L = 6, 9


def _make(seed=0):
    """Random batch exercising every branch: dual clip, KL clamp, strategy / padding rows."""
    r = np.random.default_rng(seed)
    logp = r.normal(-2.0, 1.0, (S, L))
    old = logp + r.normal(0, 0.5, (S, L))  # ratios well outside [0.8, 1.2]
    old[0, 3] = logp[0, 3] - 3.0  # ratio e^3 = 20 > c = 3 with A < 0 below: dual clip
    ref = logp + r.normal(0, 1.0, (S, L))
    ref[1, 4] = logp[1, 4] + 14.0  # q = 14 -> clamped to 10
    ref[2, 5] = logp[2, 5] - 12.0  # q = -12 -> clamped to -10
    adv = r.normal(0, 1.0, (S, L))
    adv[0, 3] = -1.5
    mask = r.random((S, L)) < 0.7
    mask[0, 3] = mask[1, 4] = mask[2, 5] = True
    mask[4] = False  # a valid row with no loss tokens (not counted by seq_mean_token_mean)
    ent = r.uniform(0.1, 3.0, (S, L))
    row_index = np.zeros((S, 4), np.int32)
    row_index[:, 3] = [0, 1, -1, 2, -1, 3]  # rows 2 and 4 are strategy rows
    valid = np.array([1, 1, 1, 1, 1, 0], bool)  # row 5 is padding
    adv = np.where(mask, adv, 0.0)
    return dict(logp=logp, old=old, ref=ref, adv=adv, mask=mask, ent=ent, row_index=row_index, valid=valid)


def _batch(d):
    return TokenBatch(
        tokens=jnp.zeros((S, L), jnp.int32),
        attention_mask=jnp.ones((S, L), bool),
        loss_mask=jnp.asarray(d["mask"]),
        old_logp=jnp.asarray(d["old"], jnp.float32),
        ref_logp=jnp.asarray(d["ref"], jnp.float32),
        advantage=jnp.asarray(d["adv"], jnp.float32),
        row_index=jnp.asarray(d["row_index"]),
        row_valid=jnp.asarray(d["valid"]),
    )


def _reference(d, eps_low, eps_high, c, beta, ent_coef, agg, lam, bonus):
    """Textbook form, float64: ratio space, explicit loops over rows and tokens."""
    tok = {"pg": [], "kl": [], "ent": [], "clip": [], "ratio": []}
    per_row = []
    weights = []
    for s in range(S):
        w = 0.0 if not d["valid"][s] else (lam if d["row_index"][s, 3] == -1 else 1.0)
        rows = {"loss": [], "pg": [], "kl": [], "ent": []}
        for i in range(L):
            if not (d["mask"][s, i] and d["valid"][s]):
                continue
            ratio = np.exp(d["logp"][s, i] - d["old"][s, i])
            a = d["adv"][s, i]
            unclipped, clipped = -a * ratio, -a * min(max(ratio, 1 - eps_low), 1 + eps_high)
            pg = max(unclipped, clipped)
            if a < 0:
                pg = min(pg, -c * a)
            q = min(max(d["ref"][s, i] - d["logp"][s, i], -10.0), 10.0)
            kl = np.exp(q) - q - 1
            e = d["ent"][s, i]
            loss = pg + beta * kl - (ent_coef * e if bonus else 0.0)
            for k, v in (("loss", loss), ("pg", pg), ("kl", kl), ("ent", e)):
                rows[k].append(v)
            tok["clip"].append(float(clipped > unclipped))
            tok["ratio"].append(ratio)
        per_row.append(rows)
        weights.append(w)
    out = {}
    for k in ("loss", "pg", "kl", "ent"):
        if agg == "token_mean":
            num = sum(w * sum(r[k]) for w, r in zip(weights, per_row))
            den = sum(len(r[k]) for r in per_row)
        else:
            num = sum(w * np.mean(r[k]) for w, r in zip(weights, per_row) if r[k])
            den = sum(1 for r in per_row if r[k])
        out[k] = num / den
    out["clip_frac"] = np.mean(tok["clip"])
    out["ratio_mean"], out["ratio_max"], out["ratio_min"] = (
        np.mean(tok["ratio"]),
        np.max(tok["ratio"]),
        np.min(tok["ratio"]),
    )
    return out


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("bonus", [False, True])
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.2, 0.28)])
def test_loss_matches_numpy(agg, bonus, eps):
    d = _make(1)
    cfg = LossConfig(
        eps_low=eps[0],
        eps_high=eps[1],
        dual_clip=3.0,
        kl_coef=0.05,
        entropy_coef=0.01,
        aggregation=agg,
        entropy_bonus=bonus,
    )
    lam = 0.5
    fn = jax.jit(lambda lp, b, e, lam: policy_loss(lp, b, cfg, lam, e))
    loss_sum, count, m = fn(jnp.asarray(d["logp"], jnp.float32), _batch(d), jnp.asarray(d["ent"], jnp.float32), lam)
    m = finalize_metrics(m)
    ref = _reference(d, eps[0], eps[1], 3.0, 0.05, 0.01, agg, lam, bonus)
    np.testing.assert_allclose(float(loss_sum / count), ref["loss"], rtol=2e-5)
    np.testing.assert_allclose(float(m["loss"]), ref["loss"], rtol=2e-5)
    np.testing.assert_allclose(float(m["pg_loss"]), ref["pg"], rtol=2e-5)
    np.testing.assert_allclose(float(m["kl"]), ref["kl"], rtol=2e-5)
    np.testing.assert_allclose(float(m["entropy"]), ref["ent"], rtol=2e-5)
    np.testing.assert_allclose(float(m["clip_frac"]), ref["clip_frac"], rtol=1e-6)
    for k in ("ratio_mean", "ratio_max", "ratio_min"):
        np.testing.assert_allclose(float(m[k]), ref[k], rtol=2e-5)
    n_tok = int((d["mask"] & d["valid"][:, None]).sum())
    assert float(count) == (n_tok if agg == "token_mean" else 4)  # rows 0..3 have tokens


def test_branches_are_exercised():
    """The fixture really hits the dual clip and both KL clamps (else the test above proves less)."""
    d = _make(1)
    cfg = LossConfig()
    _, _, m = policy_loss(jnp.asarray(d["logp"], jnp.float32), _batch(d), cfg, 1.0)
    assert float(m["dual_clip_frac"][0]) >= 1
    # the clamp changes the KL: unclamped k3 at q = 14 would be ~1.2e6
    assert float(m["kl"][0]) < 1e5
    assert abs(d["ref"][1, 4] - d["logp"][1, 4]) > 10 and abs(d["ref"][2, 5] - d["logp"][2, 5]) > 10


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_without_a_reference_the_loss_is_the_numpy_one_without_kl(agg):
    """`reference=False` (a run with kl_coef = 0 scores no reference log-probs): the loss and its
    gradient are the numpy loss with beta = 0, whatever ref_logp holds, and no "kl" is reported."""
    d = _make(3)
    d["ref"] = np.full((S, L), np.nan)  # never read
    cfg = LossConfig(kl_coef=0.0, aggregation=agg, reference=False)
    loss_fn = lambda lp: policy_loss(lp, _batch(d), cfg, 0.5)  # noqa: E731
    lp = jnp.asarray(d["logp"], jnp.float32)
    loss_sum, count, m = loss_fn(lp)
    want = _reference({**d, "ref": d["logp"]}, 0.2, 0.2, 3.0, 0.0, 0.0, agg, 0.5, False)
    np.testing.assert_allclose(float(loss_sum / count), want["loss"], rtol=2e-5)
    assert "kl" not in m and np.isfinite(float(finalize_metrics(m)["pg_loss"]))
    grad = jax.grad(lambda lp: loss_fn(lp)[0])(lp)
    with_ref = LossConfig(kl_coef=0.0, aggregation=agg)  # the same loss read through a finite reference
    d_ref = {**d, "ref": d["logp"] + 1.0}
    grad_ref = jax.grad(lambda lp: policy_loss(lp, _batch(d_ref), with_ref, 0.5)[0])(lp)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(grad_ref), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="reference=False .* needs kl_coef = 0"):
        LossConfig(kl_coef=0.01, reference=False)


def test_loss_config_reads_the_reference_only_with_a_kl_term():
    from strata_jax.train import loss_config, uses_reference

    assert loss_config({"kl_coef": 0.01}).reference and uses_reference({"kl_coef": 0.01})
    assert not loss_config({"kl_coef": 0.0}).reference and not uses_reference({"kl_coef": 0})
    assert uses_reference({})  # the default beta = 0.01


def test_row_weights():
    ri = jnp.array([[0, 0, 0, 2], [0, 0, 0, -1], [0, 0, 0, -1], [0, 0, 0, 0]])
    w = row_weights(ri, jnp.array([True, True, False, False]), 0.25)
    np.testing.assert_array_equal(np.asarray(w), [1.0, 0.25, 0.0, 0.0])


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_microbatch_sums_equal_full_batch(agg):
    d = _make(2)
    cfg = LossConfig(aggregation=agg, kl_coef=0.1)
    b = _batch(d)
    lp = jnp.asarray(d["logp"], jnp.float32)
    full_sum, full_cnt, full_m = policy_loss(lp, b, cfg, 0.5)
    acc_s, acc_c, acc_m = 0.0, 0.0, None
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        part = jax.tree.map(lambda x, rows=rows: x[rows], b)
        s_, c_, m_ = policy_loss(lp[rows], part, cfg, 0.5)
        acc_s, acc_c = acc_s + s_, acc_c + c_
        acc_m = combine_metrics(empty_metrics(m_) if acc_m is None else acc_m, m_)
    np.testing.assert_allclose(float(acc_s / acc_c), float(full_sum / full_cnt), rtol=1e-6)
    fa, fb = finalize_metrics(acc_m), finalize_metrics(full_m)
    for k in fb:
        np.testing.assert_allclose(float(fa[k]), float(fb[k]), rtol=1e-6, err_msg=k)


def test_gradient_matches_numpy_and_ignores_off_mask_nan():
    """d loss / d logp vs central differences of the numpy reference; NaN off-mask stays out."""
    d = _make(3)
    cfg = LossConfig(kl_coef=0.05)
    b = _batch(d)
    # garbage where the loss mask is off must not reach the loss or its gradient
    b = b.replace(
        advantage=jnp.where(b.loss_mask, b.advantage, jnp.nan), old_logp=jnp.where(b.loss_mask, b.old_logp, jnp.inf)
    )
    grad = jax.grad(lambda lp: (lambda s, c, _: s / c)(*policy_loss(lp, b, cfg, 0.5)))(
        jnp.asarray(d["logp"], jnp.float32)
    )
    assert np.isfinite(np.asarray(grad)).all()
    h = 1e-6
    for s, i in [(0, 3), (1, 4), (2, 5), (3, 0), (0, 1)]:
        if not d["mask"][s, i]:
            continue
        up, dn = dict(d), dict(d)
        up["logp"], dn["logp"] = d["logp"].copy(), d["logp"].copy()
        up["logp"][s, i] += h
        dn["logp"][s, i] -= h
        fd = (
            _reference(up, 0.2, 0.2, 3.0, 0.05, 0, "token_mean", 0.5, False)["loss"]
            - _reference(dn, 0.2, 0.2, 3.0, 0.05, 0, "token_mean", 0.5, False)["loss"]
        ) / (2 * h)
        np.testing.assert_allclose(float(grad[s, i]), fd, rtol=1e-3, atol=1e-6, err_msg=str((s, i)))


def test_bad_config_and_inputs_raise():
    with pytest.raises(ValueError, match="unknown mode 'mean'"):
        LossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        LossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['beta'\]"):
        config_from_dict({"beta": 0.1})
    d = _make(0)
    with pytest.raises(ValueError, match="no per-token entropy"):
        policy_loss(jnp.asarray(d["logp"]), _batch(d), LossConfig(entropy_bonus=True), 1.0)
    with pytest.raises(ValueError, match="logp shape"):
        policy_loss(jnp.zeros((S, L + 1)), _batch(d), LossConfig(), 1.0)


def test_strategy_token_gradient_is_lambda_times_strategy_advantage():
    """End to end from returns to the loss gradient: a strategy token's d loss / d logp at ratio 1
    is -lam * A^str / count with A^str = norm_i(R(z_i)) (ALGORITHMS.md 3.5: lambda once, in the loss).
    Hand case: one task, two strategies with returns (10, 10) and (0, 0) -> R(z) = (1, 0), so
    A^str = (+0.7071, -0.7071) (ddof 1). An action row rides along to fix the shared count."""
    from strata_jax.advantages import compute_advantages
    from strata_jax.advantages.params import AdvantageParams
    from strata_jax.batch import TrajectoryBatch, gather_advantages

    P, N, M, H = 1, 2, 2, 1
    won = np.array([[[True, True], [False, False]]])
    traj = TrajectoryBatch.from_numpy(
        step_mask=np.ones((P, N, M, H), bool),
        won=won,
        episode_return=(10.0 * won).astype(np.float32),
        env_reward=np.zeros((P, N, M, H), np.float32),
        invalid=np.zeros((P, N, M, H), bool),
        milestone=np.zeros((P, N, M, H), bool),
        judged_bad=np.zeros((P, N, M, H), bool),
        anchor_id=np.zeros((P, N, M, H), np.int64),
        action_id=np.zeros((P, N, M, H), np.int64),
        strategy_mask=np.ones((P, N), bool),
        strategy_len=np.full((P, N), 10, np.int32),
        strategy_malformed=np.zeros((P, N), bool),
        horizon=np.full((P,), 2, np.int32),
    )
    lam = 0.5
    adv = compute_advantages(traj, AdvantageParams(lam_strategy=lam), "strata")
    a_str = 1.0 / np.sqrt(2.0)  # norm([1, 0]) with ddof 1
    np.testing.assert_allclose(np.asarray(adv.strategy), [[a_str, -a_str]], atol=1e-5)

    # rows: strategy z_0 (3 tokens), strategy z_1 (3 tokens), action (0, 0, 0, 0) (2 tokens)
    Lr = 4
    loss_mask = np.array([[0, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]], bool)
    row_index = np.array([[0, 0, 0, -1], [0, 1, 0, -1], [0, 0, 0, 0]], np.int32)
    zeros = jnp.zeros((3, Lr), jnp.float32)
    tb = TokenBatch(
        tokens=jnp.zeros((3, Lr), jnp.int32),
        attention_mask=jnp.ones((3, Lr), bool),
        loss_mask=jnp.asarray(loss_mask),
        old_logp=zeros,
        ref_logp=zeros,
        advantage=zeros,
        row_index=jnp.asarray(row_index),
        row_valid=jnp.ones(3, bool),
    )
    tb = gather_advantages(adv.step, adv.strategy, tb)
    cfg = LossConfig(kl_coef=1e-9)  # KL gradient is 0 at logp = ref anyway

    def loss(logp):
        s, c, _ = policy_loss(logp, tb, cfg, lam)
        return s / c

    g = np.asarray(jax.grad(loss)(zeros))  # logp = old_logp: ratio 1, unclipped
    count = loss_mask.sum()
    np.testing.assert_allclose(g[0, 1:], -lam * a_str / count, rtol=1e-5)
    np.testing.assert_allclose(g[1, 1:], +lam * a_str / count, rtol=1e-5)
    assert np.all(g[~loss_mask] == 0)
