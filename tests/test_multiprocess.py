"""Training across two processes (jax.distributed on CPU, gloo collectives) equals one process.

The end-to-end test launches `launch.py train` twice on localhost (process 0 and 1, each with one
CPU device, its own environments and its own rollout shard) and, beside them, the single-process
reference with the same global batch and seeds (`mesh.rollout_shards=2`: the one process collects
both shards one after the other). After 2 iterations the params (fp32) and every per-iteration
train and eval metric must agree. The fast tests check the pieces the multi-process run is built
from: merging rollout shards equals one collect over all tasks, the shard split, the config keys.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from tests.test_launch import CONFIG, REPO, SMALL, TINY, launch, start_from_flags

# --- merging rollout shards ---------------------------------------------------------------------


def _content_script(msgs, kind, key):
    """Outputs that depend on the prompt text and the within-task key only (never on the task's
    position p in the batch), so a task's rollouts do not depend on which shard collected it."""
    from rollout.policy import messages_text

    h = zlib.crc32(messages_text(msgs).encode())
    if kind == "strategy":
        k = key[1]
        word = ["alpha", "beta", "gamma", "delta", "epsilon"][(h + k) % 5]
        return f"<strategy>{word} plan {k}</strategy>" if (h + k) % 4 else f"{word} without tags"
    if kind == "judge":
        return f"<bad_steps>{1 + h % 2}</bad_steps>" if h % 3 else "unclear"
    act = ["forward", "wait", None][(h + key[2] + key[3]) % 3]
    return f"<think>go</think><action>{act}</action>" if act else "no tags at all"


def _partition(ids: np.ndarray) -> list:
    """Ids per task as first-occurrence labels: equal partitions compare equal."""
    out = []
    for task in ids:
        seen: dict = {}
        out.append([seen.setdefault(int(i), len(seen)) if i >= 0 else -1 for i in task.reshape(-1)])
    return out


def test_merged_shards_equal_one_collect_over_all_tasks():
    from rollout.collect import RolloutConfig, collect
    from rollout.policy import ScriptedPolicy
    from rollout.shards import merge_results, shard_tasks, to_host
    from tests.test_collect import Corridor

    cfg = RolloutConfig(
        mode="strata", num_strategies=2, traj_per_strategy=2, oversample=2, max_steps=4, progress=False, row_multiple=8
    )
    tasks = [5, 2, 4, 6]
    whole = collect([Corridor(4) for _ in range(16)], ScriptedPolicy(_content_script), tasks, cfg)
    parts = [
        to_host(collect([Corridor(4) for _ in range(8)], ScriptedPolicy(_content_script), t, cfg))
        for t in shard_tasks(tasks, 2)
    ]
    merged = merge_results(parts, cfg)
    # the shards differ (goal room 3 and 2 vs 2 and 2): not one batch repeated
    assert not np.array_equal(np.asarray(parts[0].tokens.tokens), np.asarray(parts[1].tokens.tokens))
    for name in whole.traj.__dataclass_fields__:
        a, b = np.asarray(getattr(merged.traj, name)), np.asarray(getattr(whole.traj, name))
        if name in ("anchor_id", "action_id"):  # dense relabels: compare the grouping per task
            assert _partition(a) == _partition(b), name
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)
    for name in whole.tokens.__dataclass_fields__:
        np.testing.assert_array_equal(
            np.asarray(getattr(merged.tokens, name)), np.asarray(getattr(whole.tokens, name)), err_msg=name
        )
    timing = {"time_s", "policy_time_s", "env_time_s", "build_time_s", "non_policy_share"}
    assert list(merged.stats) == list(whole.stats)
    for k in set(whole.stats) - timing:
        assert merged.stats[k] == whole.stats[k], k
    assert merged.texts == whole.texts


def test_shard_split_and_its_errors():
    from rollout.shards import process_shards, shard_tasks

    assert shard_tasks([1, 2, 3, 4, 5, 6], 3) == [[1, 2], [3, 4], [5, 6]]
    assert list(process_shards(4, 1, 2)) == [2, 3] and list(process_shards(2, 0, 1)) == [0, 1]
    with pytest.raises(ValueError, match="do not split into 4 rollout shards"):
        shard_tasks([1, 2, 3, 4, 5, 6], 4)
    with pytest.raises(ValueError, match="multiple of the process count"):
        process_shards(3, 0, 2)


def test_mesh_config_keys_are_validated():
    from configs.base import ConfigError, validate
    from configs.tiny_household import get_config

    def bad(match, **mesh):
        c = get_config()
        c.algo.tasks_per_iter = 4
        c.mesh.update(mesh)
        with pytest.raises(ConfigError, match=match):
            validate(c)

    bad("only apply with --config.mesh.distributed=True", num_processes=2)
    bad("only apply with --config.mesh.distributed=True", coordinator_address="localhost:1234")
    bad("must divide by the 3 rollout shards", distributed=True, num_processes=3)
    bad("must divide by config.mesh.rollout_shards", rollout_shards=3)
    bad("multiple of num_processes=4", distributed=True, num_processes=4, rollout_shards=2)
    bad("must be < num_processes", distributed=True, num_processes=2, process_id=2)
    c = get_config()
    c.algo.tasks_per_iter = 4
    c.mesh.update(dict(distributed=True, num_processes=2, process_id=1, rollout_shards=4))
    validate(c)


def test_distributed_options_fall_back_to_jax_environment_variables(monkeypatch):
    from strata_jax import sharding as sh

    cfg = {"coordinator_address": "", "num_processes": 0, "process_id": -1, "local_device_ids": ""}
    for var in sh.DIST_ENV.values():
        monkeypatch.delenv(var, raising=False)
    assert sh.distributed_options(cfg) == {}  # left to jax's auto-detection
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert sh.distributed_options(cfg) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    given = {**cfg, "coordinator_address": "h:1", "num_processes": 2, "process_id": 0, "local_device_ids": "0,1"}
    assert sh.distributed_options(given) == {
        "coordinator_address": "h:1",
        "num_processes": 2,
        "process_id": 0,
        "local_device_ids": [0, 1],
    }  # config wins over the environment
    monkeypatch.setenv("JAX_PROCESS_ID", "five")
    with pytest.raises(sh.ShardingError, match="JAX_PROCESS_ID"):
        sh.distributed_options(cfg)
    monkeypatch.setenv("JAX_PROCESS_ID", "4")
    with pytest.raises(sh.ShardingError, match=r"process_id=4 is not in \[0, num_processes=4\)"):
        sh.distributed_options(cfg)


# --- two processes vs one -----------------------------------------------------------------------

ITERATIONS = ["--config.iterations=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _tail(path: pathlib.Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no output)"


def _launch_together(commands: dict[str, list[str]], logdir: pathlib.Path, timeout: float) -> None:
    """Start every command at once; wait for all. The first failure (or the timeout) stops the
    others (a process whose peer died would otherwise wait in a collective) and raises with every
    process's stderr."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device per process, as a user's launch would have
    procs = {}
    for name, args in commands.items():
        out, err = open(logdir / f"{name}.out", "w"), open(logdir / f"{name}.err", "w")
        procs[name] = subprocess.Popen(
            [sys.executable, str(REPO / "launch.py"), *args], cwd=REPO, env=env, stdout=out, stderr=err
        )
    deadline = time.monotonic() + timeout
    problem = None
    while problem is None and any(p.poll() is None for p in procs.values()):
        failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
        if failed:
            problem = f"{failed[0]} exited with {procs[failed[0]].returncode}"
        elif time.monotonic() > deadline:
            problem = f"timed out after {timeout:.0f} s"
        else:
            time.sleep(0.5)
    if problem is None:
        failed = [n for n, p in procs.items() if p.returncode != 0]
        problem = f"{failed[0]} exited with {procs[failed[0]].returncode}" if failed else None
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
    if problem:
        logs = "\n".join(f"--- {n} stderr ---\n{_tail(logdir / f'{n}.err')}" for n in procs)
        raise AssertionError(f"multi-process launch failed: {problem}\n{logs}")


def _metrics(workdir: pathlib.Path) -> list[dict]:
    with open(workdir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _checkpoint_arrays(path: pathlib.Path) -> dict[str, np.ndarray]:
    """A saved train state as host arrays, restored on this process's first device whatever mesh
    (and process count) wrote it."""
    import jax
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    meta = ckptr.metadata(path)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), tree)
    restored = ckptr.restore(path, target)
    pairs = jax.tree_util.tree_flatten_with_path(restored)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in p): np.asarray(v) for p, v in pairs}


@pytest.fixture(scope="module")
def two_process_and_reference(tmp_path_factory):
    """(two-process workdir, single-process workdir, SFT model dir), all runs of 2 iterations."""
    sft = tmp_path_factory.mktemp("mp_sft")
    launch("sft", *CONFIG, *TINY, *SMALL, "--workdir", str(sft))
    model = sft / "sft_model"
    common = [*CONFIG, *SMALL, *ITERATIONS, *start_from_flags(model)]
    multi, single = tmp_path_factory.mktemp("mp_two"), tmp_path_factory.mktemp("mp_one")
    dist = [
        "--config.mesh.distributed=True",
        f"--config.mesh.coordinator_address=localhost:{_free_port()}",
        "--config.mesh.num_processes=2",
    ]
    logs = tmp_path_factory.mktemp("mp_logs")
    _launch_together(
        {
            "process0": [*common, *dist, "--config.mesh.process_id=0", "--workdir", str(multi)],
            "process1": [*common, *dist, "--config.mesh.process_id=1", "--workdir", str(multi)],
            "reference": [*common, "--config.mesh.rollout_shards=2", "--workdir", str(single)],
        },
        logs,
        timeout=900,
    )
    return multi, single, model


@pytest.mark.slow
def test_two_processes_train_the_same_params_as_one(two_process_and_reference):
    multi, single, _ = two_process_and_reference
    got = _checkpoint_arrays(multi / "checkpoints" / "2" / "state")
    want = _checkpoint_arrays(single / "checkpoints" / "2" / "state")
    start = _checkpoint_arrays(single / "checkpoints" / "1" / "state")
    assert set(got) == set(want)
    params = [k for k in want if k.startswith("params/")]
    assert len(params) > 10
    for k in want:
        assert got[k].dtype == want[k].dtype == np.float32 or got[k].dtype.kind != "f", k
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
    # the second iteration moved the params far more than the tolerance: the check can fail
    moved = max(float(np.abs(want[k] - start[k]).max()) for k in params)
    assert moved > 1e-3, moved


@pytest.mark.slow
def test_two_processes_report_the_same_metrics_as_one(two_process_and_reference):
    multi, single, _ = two_process_and_reference
    got, want = _metrics(multi), _metrics(single)
    # process 0 alone writes the log: one row per iteration, not one per process
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want] == [0, 1, 2]
    for a, b in zip(got, want):
        keys = [k for k in b if not k.startswith("time/")]
        assert sorted(k for k in a if not k.startswith("time/")) == sorted(keys)
        for k in keys:
            # train/* and eval/* come from the same rollouts; update/* from a step on 2 devices vs 1
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["iteration"], k)
    assert got[1]["train/num_trajectories"] == 8  # both processes' shards: P * N * M
    assert "eval/success" in got[0] and "eval/success" in got[2]  # process 0 evaluated alone


@pytest.mark.slow
def test_process_zero_saves_the_global_batch(two_process_and_reference):
    multi, single, _ = two_process_and_reference
    for it in (1, 2):
        a = np.load(multi / "batches" / f"iter_{it:05d}.npz")
        b = np.load(single / "batches" / f"iter_{it:05d}.npz")
        assert a["step_mask"].shape[0] == 2  # P = 2 tasks: both shards
        for name in b.files:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        texts = json.loads((multi / "batches" / f"iter_{it:05d}.texts.json").read_text())
        assert sorted({t["key"][0] for t in texts["trajectories"]}) == [0, 1]
