"""Env pools: batched results equal per-env references; crashes and hangs are recovered."""

import functools

import pytest

from rollout.envs import make_env
from rollout.envs.base import EnvError
from rollout.envs.household import HouseholdEnv
from rollout.envs.vector import EnvFailure, EnvPool, SerialEnvPool

make = functools.partial(make_env, "household", max_steps=30)
SEEDS = [5, 5, 6, 7]


class Reference:
    """Plain in-process envs stepped with the same commands: what each pool slot must return."""

    def __init__(self, n):
        self.envs = [make() for _ in range(n)]

    def reset(self, idx, seeds):
        return [self.envs[i].reset(seed=s) for i, s in zip(idx, seeds)]

    def step(self, idx, actions):
        return [self.envs[i].step(a) for i, a in zip(idx, actions)]


def failed(r, kind):
    return isinstance(r, EnvFailure) and r.crashed and r.kind == kind


def test_registry():
    assert isinstance(make_env("household"), HouseholdEnv)
    with pytest.raises(ValueError, match="household, alfworld, scienceworld"):
        make_env("minecraft")


def test_serial_pool_matches_envs_and_reports_faults():
    pool, ref = SerialEnvPool([make] * 3, fault_injection=True), Reference(3)
    assert pool.num_envs == 3
    assert pool.reset([0, 1, 2], SEEDS[:3]) == ref.reset([0, 1, 2], SEEDS[:3])
    assert pool.step([2, 0], ["look", "inventory"]) == ref.step([2, 0], ["look", "inventory"])
    out = pool.step([0, 1, 2], ["__raise__", "__crash__", "look"])
    assert failed(out[0], "exception") and "injected" in out[0].error
    assert failed(out[1], "crash") and out[2] == ref.step([2], ["look"])[0]
    assert failed(pool.step([2], ["__hang__"])[0], "timeout")
    assert pool.reset([1], [7]) == ref.reset([1], [7])  # the rebuilt env works
    assert pool.stats["crash"] == pool.stats["timeout"] == pool.stats["exception"] == 1


def test_bad_batches_raise():
    pool = SerialEnvPool([make] * 2)
    with pytest.raises(ValueError, match="duplicate"):
        pool.reset([0, 0], [1, 2])
    with pytest.raises(ValueError, match="out of range"):
        pool.step([2], ["look"])
    with pytest.raises(ValueError, match="2 env_indices but 1 actions"):
        pool.step([0, 1], ["look"])


@pytest.fixture(scope="module")
def pool():
    # 4 envs on 2 workers: env 0 and 2 share worker 0, env 1 and 3 share worker 1.
    p = EnvPool([make] * 4, num_workers=2, timeout_s=5.0, fault_injection=True)
    yield p
    p.close()


def test_process_pool_crash_and_hang_recovered(pool):
    ref = Reference(4)
    assert pool.reset([0, 1, 2, 3], SEEDS) == ref.reset([0, 1, 2, 3], SEEDS)
    assert pool.step([0, 1, 2, 3], ["look"] * 4) == ref.step([0, 1, 2, 3], ["look"] * 4)
    pids = [p.pid for p in pool.procs]

    # Env 1 kills its worker; env 3, queued behind it on the same worker, still gets its answer.
    out = pool.step([0, 1, 2, 3], ["inventory", "__crash__", "inventory", "look"])
    assert failed(out[1], "crash") and "exit code 17" in out[1].error
    assert [out[i] for i in (0, 2, 3)] == ref.step([0, 2, 3], ["inventory", "inventory", "look"])
    assert pool.procs[1].pid != pids[1] and pool.procs[0].pid == pids[0]

    # Env 3's episode was replayed on the new worker: it continues exactly where it was.
    plan = ref.envs[3].plan
    assert pool.step([3], plan[:1]) == ref.step([3], plan[:1])
    lost = pool.step([1], ["look"])[0]  # env 1's episode is gone until it is reset
    assert failed(lost, "restarted") and "reset" in lost.error

    # Env 0 hangs worker 0 past the timeout: killed, restarted; env 2 is answered all the same.
    out = pool.step([2, 0, 3], ["look", "__hang__", "look"])
    assert failed(out[1], "timeout")
    assert [out[0], out[2]] == ref.step([2, 3], ["look", "look"])
    assert pool.procs[0].pid != pids[0]

    # Exceptions inside an env do not cost the worker.
    pid = pool.procs[0].pid
    assert failed(pool.step([2], ["__raise__"])[0], "exception") and pool.procs[0].pid == pid

    # Reset brings the failed envs back; the rest finish their tasks.
    assert pool.reset([0, 1, 2], SEEDS[:3]) == ref.reset([0, 1, 2], SEEDS[:3])
    for action in ref.envs[3].plan[1:]:
        assert pool.step([3], [action]) == ref.step([3], [action])
    assert ref.envs[3].won
    after = pool.step([3], ["look"])[0]  # the env's own error travels back as the record
    assert failed(after, "exception") and "after the episode ended" in after.error
    assert pool.stats["crash"] == 1 and pool.stats["timeout"] == 1 and pool.stats["restarts"] == 2


def test_fault_actions_are_plain_text_without_injection():
    with EnvPool([make], num_workers=1, timeout_s=30.0) as p:
        p.reset([0], [3])
        obs, *_ = p.step([0], ["__crash__"])[0]
        assert obs == "Nothing happens."


def _broken_env():
    raise RuntimeError("no such game folder")


def test_worker_that_cannot_build_its_env_is_a_clear_error():
    with pytest.raises(EnvError, match="could not build its envs(.|\n)*no such game folder"):
        EnvPool([_broken_env], num_workers=1, timeout_s=30.0)
