"""Slow, obviously-correct reference of the revision and judgment objectives (test-only), from the
formulas in docs/CONTRACTS.md ("Strategy revision and trained self-judgment"), with Python loops in
float64. Shares no code with strata_jax. `b`: dict of numpy arrays with the TrajectoryBatch field names."""

from __future__ import annotations

import math

import numpy as np

EPS = 1e-6


def _norm(values):
    n = len(values)
    if n < 2:
        return [0.0] * n
    mean = sum(values) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1))
    return [(x - mean) / (std + EPS) for x in values]


def _in_batch(b, p, n, m):
    return bool(b["step_mask"][p, n, m].any())


def revision_reference(b, r_succ=10.0, c_len=0.1, c_fmt=0.1, budget=64.0):
    """[P, N, M, R] float64: A^rev, grouped by (task, revision index)."""
    P, N, M, R = b["revision_mask"].shape
    out = np.zeros((P, N, M, R))
    for p in range(P):
        for r in range(R):
            members, rewards = [], []
            for n in range(N):
                for m in range(M):
                    if not (b["revision_mask"][p, n, m, r] and _in_batch(b, p, n, m)):
                        continue
                    length = float(b["revision_len"][p, n, m, r])
                    x = (
                        float(b["episode_return"][p, n, m]) / r_succ
                        - c_len * max(0.0, length - budget) / budget
                        - c_fmt * float(b["revision_malformed"][p, n, m, r])
                    )
                    members.append((n, m))
                    rewards.append(min(1.0, max(-1.0, x)))
            for (n, m), a in zip(members, _norm(rewards)):
                out[p, n, m, r] = a
    return out


def judge_reference(b):
    """[P, N, M, J] float64: A^judge, GRPO over each trajectory's judgments."""
    P, N, M, J = b["judge_valid"].shape
    H = b["step_mask"].shape[3]
    out = np.zeros((P, N, M, J))
    for p in range(P):
        for n in range(N):
            for m in range(M):
                if not _in_batch(b, p, n, m):
                    continue
                labelled = [t for t in range(H) if b["step_mask"][p, n, m, t] and b["step_label"][p, n, m, t] != 0]
                js, rewards = [], []
                for j in range(J):
                    if not b["judge_valid"][p, n, m, j]:
                        continue
                    if not b["judge_ok"][p, n, m, j]:
                        x = -1.0
                    elif not labelled:
                        x = 0.0
                    else:
                        right = sum(
                            1
                            for t in labelled
                            if bool(b["judge_sets"][p, n, m, j, t]) == (b["step_label"][p, n, m, t] < 0)
                        )
                        x = right / len(labelled)
                    js.append(j)
                    rewards.append(x)
                for j, a in zip(js, _norm(rewards)):
                    out[p, n, m, j] = a
    return out
