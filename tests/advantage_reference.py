"""Slow, obviously-correct reference of the advantage estimators (test-only).

Written from ALGORITHMS.md sections 0-4 with explicit Python loops in float64; it shares no code
with strata_jax. Inputs: `b`, a dict of numpy arrays with the TrajectoryBatch field names, and `hp`,
a dict of hyper-parameters with the AdvantageParams field names (plain floats / str / bool).
The choices the library documents (GiGPO step rewards, ceil slack, "entered a segment", lambda
folded into A^str, stats_over_steps on GRPO / GiGPO A^E) are re-implemented here independently.
"""

from __future__ import annotations

import math

import numpy as np

EPS = 1e-6


def _norm(values, mode="std", weights=None):
    """norm / center over one group; a one-member group gives 0."""
    n = len(values)
    if n < 2:
        return [0.0] * n
    w = [1.0] * n if weights is None else [float(x) for x in weights]
    total = sum(w)
    mean = sum(wi * x for wi, x in zip(w, values)) / total
    if mode == "mean":
        return [x - mean for x in values]
    var = sum(wi * (x - mean) ** 2 for wi, x in zip(w, values)) / (total - 1.0)
    std = math.sqrt(var)
    return [(x - mean) / (std + EPS) for x in values]


def _steps(b, p, n, m):
    """Valid step indices of one trajectory, in time order."""
    return [t for t in range(b["step_mask"].shape[3]) if b["step_mask"][p, n, m, t]]


def _trajs(b):
    P, N, M, _ = b["step_mask"].shape
    return [(p, n, m) for p in range(P) for n in range(N) for m in range(M) if _steps(b, p, n, m)]


def _finalize(b, hp, step):
    """Invalid penalty after normalisation on invalid steps; padded steps 0."""
    out = np.zeros(b["step_mask"].shape)
    for idx in zip(*np.nonzero(b["step_mask"])):
        out[idx] = step[idx] - (hp["invalid_penalty"] if b["invalid"][idx] else 0.0)
    return out


def _traj_norm(b, key_of, mode, weighted=False):
    """Normalise R(tau) over groups of trajectories keyed by key_of(p, n, m) -> {(p,n,m): A}."""
    groups = {}
    for tr in _trajs(b):
        groups.setdefault(key_of(*tr), []).append(tr)
    out = {}
    for members in groups.values():
        vals = [float(b["episode_return"][tr]) for tr in members]
        w = [len(_steps(b, *tr)) for tr in members] if weighted else None
        for tr, a in zip(members, _norm(vals, mode, w)):
            out[tr] = a
    return out


def grpo(b, hp):
    step = np.zeros(b["step_mask"].shape)
    a = _traj_norm(b, lambda p, n, m: p, "std", hp["stats_over_steps"])
    for (p, n, m), v in a.items():
        for t in _steps(b, p, n, m):
            step[p, n, m, t] = v
    return step, np.zeros(b["strategy_mask"].shape)


def gigpo_returns(b, hp, p, n, m):
    """{t: R_t} with r_k = env reward, plus R(tau) - sum(env reward) on the last valid step."""
    ts = _steps(b, p, n, m)
    r = {t: float(b["env_reward"][p, n, m, t]) for t in ts}
    r[ts[-1]] += float(b["episode_return"][p, n, m]) - sum(r.values())
    g = hp["gamma"]
    return {t: sum(g ** (k - t) * r[k] for k in ts if k >= t) for t in ts}


def gigpo(b, hp):
    mode = hp["gigpo_norm"]
    step = np.zeros(b["step_mask"].shape)
    a_e = _traj_norm(b, lambda p, n, m: p, mode, hp["stats_over_steps"])
    anchors = {}
    ret = {}
    for tr in _trajs(b):
        for t, v in gigpo_returns(b, hp, *tr).items():
            ret[tr + (t,)] = v
            aid = int(b["anchor_id"][tr + (t,)])
            key = (tr[0], aid) if aid >= 0 else ("alone",) + tr + (t,)
            anchors.setdefault(key, []).append(tr + (t,))
    a_s = {}
    for members in anchors.values():
        for s, a in zip(members, _norm([ret[s] for s in members], mode)):
            a_s[s] = a
    for s in ret:
        step[s] = a_e[s[:3]] + hp["omega"] * a_s[s]
    return step, np.zeros(b["strategy_mask"].shape)


def strategy_rewards(b, hp):
    """{(p, n): R(z)} for strategies that exist and have at least one valid trajectory."""
    P, N, M, _ = b["step_mask"].shape
    out = {}
    for p in range(P):
        for n in range(N):
            rets = [float(b["episode_return"][p, n, m]) for m in range(M) if _steps(b, p, n, m)]
            if not b["strategy_mask"][p, n] or not rets:
                continue
            k = math.ceil(hp["delta"] * len(rets) - 1e-4)
            k = min(max(k, 1), len(rets))
            top = sorted(rets, reverse=True)[:k]
            lz = hp["strategy_budget"]
            r = (
                sum(top) / k / hp["r_succ"]
                - hp["c_len"] * max(0.0, float(b["strategy_len"][p, n]) - lz) / lz
                - hp["c_fmt"] * float(b["strategy_malformed"][p, n])
            )
            out[(p, n)] = min(1.0, max(-1.0, r))
    return out


def strategy_adv(b, hp):
    out = np.zeros(b["strategy_mask"].shape)
    rz = strategy_rewards(b, hp)
    for p in range(out.shape[0]):
        keys = [k for k in rz if k[0] == p]
        for k, a in zip(keys, _norm([rz[k] for k in keys], "std")):
            out[k] = a  # lam_strategy weights the loss, not A^str
    return out


def strata(b, hp):
    step = np.zeros(b["step_mask"].shape)
    a = _traj_norm(b, lambda p, n, m: (p, n), "std")
    for (p, n, m), v in a.items():
        for t in _steps(b, p, n, m):
            step[p, n, m, t] = v - hp["kappa"] * float(b["judged_bad"][p, n, m, t])
    return step, strategy_adv(b, hp)


def beacon_rewards(b, hp, p, n, m):
    """{t: (segment id, r_t)} for the valid steps of one trajectory."""
    ts = _steps(b, p, n, m)
    ms = [t for t in ts if b["milestone"][p, n, m, t]]
    out = {}
    for t in ts:
        seg = sum(1 for u in ms if u < t)
        later = [u for u in ms if u >= t]
        r = hp["r_ms"] * hp["beacon_gamma"] ** (later[0] - t) if later else 0.0
        out[t] = (seg, r)
    return out


def beacon_steps(b, hp, per_strategy):
    owner = (lambda p, n, m: (p, n)) if per_strategy else (lambda p, n, m: p)
    step = np.zeros(b["step_mask"].shape)
    a_traj = _traj_norm(b, owner, "mean")
    groups = {}
    rew = {}
    for tr in _trajs(b):
        for t, (seg, r) in beacon_rewards(b, hp, *tr).items():
            rew[tr + (t,)] = r
            groups.setdefault((owner(*tr), seg), []).append(tr + (t,))
    for members in groups.values():
        n_traj = len({s[:3] for s in members})
        vals = [rew[s] for s in members]
        adv = _norm(vals, hp["seg_norm"]) if n_traj >= 2 else [0.0] * len(vals)
        for s, a in zip(members, adv):
            step[s] = a_traj[s[:3]] + hp["lam_seg"] * a
    return step


def beacon(b, hp):
    return beacon_steps(b, hp, False), np.zeros(b["strategy_mask"].shape)


def strata_beacon(b, hp):
    step = beacon_steps(b, hp, True) - hp["kappa"] * b["judged_bad"].astype(float)
    return step, strategy_adv(b, hp)


ALGOS = {"grpo": grpo, "gigpo": gigpo, "strata": strata, "beacon": beacon, "strata+beacon": strata_beacon}


def reference_advantages(b, hp, algo):
    """-> (step [P, N, M, H] float64, strategy [P, N] float64)."""
    step, strategy = ALGOS[algo](b, hp)
    return _finalize(b, hp, step), strategy


def reference_diagnostics(b, a):
    """Loop reference for ESU, CAR and CCR -> (esu, number of CAR keys, car, ccr).

    a: [P, N, M, H] step advantages. Undefined ratios are 0, as in strata_jax.diagnostics.
    """
    P, N, M, H = b["step_mask"].shape
    steps = [
        (p, n, m, t)
        for p in range(P)
        for n in range(N)
        for m in range(M)
        for t in range(H)
        if b["step_mask"][p, n, m, t]
    ]
    nz = sum(abs(a[s]) > 1e-6 for s in steps)
    keys = {}
    for s in steps:
        if b["anchor_id"][s] >= 0 and b["action_id"][s] >= 0:
            keys.setdefault((s[0], b["anchor_id"][s], b["action_id"][s]), []).append(s)
    shared = [v for v in keys.values() if len({s[:3] for s in v}) >= 2]
    both = [v for v in shared if any(a[s] > 1e-6 for s in v) and any(a[s] < -1e-6 for s in v)]
    ms = [abs(a[s]) for s in steps if b["milestone"][s]]
    other = [abs(a[s]) for s in steps if not b["milestone"][s]]
    ccr = np.mean(ms) / np.mean(other) if ms and other and np.mean(other) > 0 else 0.0
    esu = nz / len(steps) if steps else 0.0
    return esu, len(shared), (len(both) / len(shared) if shared else 0.0), ccr
