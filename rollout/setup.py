"""What a run is set up from: the device mesh, the environment pools, the task seeds of an iteration
and of the evaluation, and the run config read as rollout settings, AdvantageParams and the loss's
settings. Pure functions of the config (the mesh and pools aside); no model here.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from configs.base import PROCEDURAL_ENVS
from rollout.collect import RolloutConfig
from strata_jax import sharding
from strata_jax.advantages.params import AdvantageParams


def make_mesh(config) -> jax.sharding.Mesh:
    """The global mesh; with config.mesh.distributed, jax.distributed is initialised first
    (coordinator address, process count and id from config.mesh or JAX_* variables)."""
    sharding.maybe_init_distributed(config.mesh)
    n = jax.device_count()
    data, tensor = int(config.mesh.data), int(config.mesh.tensor)
    fsdp = int(config.mesh.fsdp) if config.mesh.fsdp > 0 else n // (data * tensor)
    if data * fsdp * tensor != n:
        raise ValueError(f"config.mesh data={data} x fsdp={fsdp} x tensor={tensor} != {n} devices")
    return sharding.make_mesh({"data": data, "fsdp": fsdp, "tensor": tensor})


def rollout_shards(config) -> int:
    """Shards an iteration's P tasks are collected in (config.mesh.rollout_shards, 0 = one per
    process). Checked here as well as in validate(): the process count may be auto-detected."""
    shards = int(config.mesh.rollout_shards) or jax.process_count()
    p = int(config.algo.tasks_per_iter)
    if shards % jax.process_count():
        raise ValueError(
            f"config.mesh.rollout_shards={shards} must be a multiple of the {jax.process_count()} "
            "processes: every process collects whole shards"
        )
    if p % shards:
        raise ValueError(
            f"config.algo.tasks_per_iter={p} must divide by the {shards} rollout shards "
            f"({jax.process_count()} processes, config.mesh.rollout_shards="
            f"{int(config.mesh.rollout_shards)}): each shard collects P / shards tasks"
        )
    return shards


def model_settings(config) -> dict:
    """load_hf_model's keyword arguments from config.model, for every load of the policy (the SFT
    warm start and the RL run), so that none of them drops a setting."""
    m = config.model
    return dict(
        dtype=str(m.dtype),
        param_dtype=str(m.param_dtype),
        scan_layers=bool(m.scan_layers),
        remat=bool(m.remat),
        attention=str(m.attention),
        lora_rank=int(m.lora_rank),
        lora_alpha=float(m.lora_alpha),
        lora_targets=tuple(m.lora_targets),
    )


def fitted_settings(
    config,
    hf_dir,
    what: str,
    rows: int,
    length: int,
    *,
    train: bool = True,
    window: int | None = None,
    reference: bool = False,
    devices: int = 1,
    settings: dict | None = None,
) -> tuple[dict, object]:
    """`settings` (default `model_settings(config)`), with remat over scanned layers turned on when
    the phase fits only so (strata_jax/memory.py), and the phase's memory estimate;
    DoesNotFitError (the arithmetic) when it cannot fit at all. Checked before the model is loaded
    and any step compiled."""
    from strata_jax import memory
    from strata_jax.models.config import ModelConfig
    from strata_jax.models.hf import load_hf_config

    settings = dict(model_settings(config) if settings is None else settings)
    m = ModelConfig.from_hf(load_hf_config(hf_dir), **settings)
    available, where = memory.available_bytes()
    rows_here = max(1, -(-int(rows) // max(int(devices), 1)))
    remat_now = settings["remat"] and settings["scan_layers"]
    remat, est = memory.plan(
        m,
        what,
        rows_here,
        int(length),
        train=train,
        remat=remat_now,
        available=available,
        where=where,
        window=window,
        chunk=int(config.train.logprob_chunk),
        reference=reference,
        devices=devices,
    )
    if remat and not remat_now:
        settings.update(remat=True, scan_layers=True)
        if config.log.progress:
            print(f"memory: {what} fits only with remat over scanned layers; turned on: {est.breakdown()}", flush=True)
    return settings, est


def env_kwargs(config, split: str | None = None) -> dict:
    e = config.env
    if e.name in PROCEDURAL_ENVS:
        from rollout.demos import expert_env_kwargs

        return expert_env_kwargs(config)
    if e.name == "alfworld":
        return {
            "data_dir": str(e.data_dir),
            "split": split or e.split,
            "max_steps": int(e.max_steps),
            "milestones": config.algo.milestones,
            "cache_dir": str(e.cache_dir) or None,
        }
    return {"max_steps": int(e.max_steps)}


def make_envs(config, count: int, split: str | None = None):
    """A pool of `count` environments: in this process (num_workers = 0) or in worker processes.

    Either way a crashing environment becomes a failure record (masked out and counted by the
    rollout loop), never an exception that stops the run.
    """
    from rollout.envs.vector import EnvPool, SerialEnvPool

    fns = [_EnvFactory(config.env.name, env_kwargs(config, split)) for _ in range(count)]
    if config.env.num_workers > 0:
        return EnvPool(fns, num_workers=int(config.env.num_workers), timeout_s=float(config.env.timeout_s))
    return SerialEnvPool(fns)


@dataclasses.dataclass
class _EnvFactory:
    """Picklable env constructor for worker processes."""

    name: str
    kwargs: dict

    def __call__(self, *_):
        from rollout.envs import make_env

        return make_env(self.name, **self.kwargs)


def trajectories_per_task(config) -> int:
    """Trajectories the rollout runs per task: N x M for StraTA, G for the flat algorithms."""
    cfg = RolloutConfig.from_config(config)
    return cfg.n * cfg.m


def num_tasks(config, split: str) -> int | None:
    if config.env.name in PROCEDURAL_ENVS:  # held-out tasks are seeds past eval_seed_offset
        return None
    from rollout.envs import make_env

    env = make_env(config.env.name, **env_kwargs(config, split))
    n = getattr(env, "num_tasks", None)
    if hasattr(env, "close"):
        env.close()
    return n


def train_tasks(config, iteration: int, n_train: int | None) -> list[int]:
    """The P task seeds of an iteration: a pure function of (seed, iteration).

    `algo.task_sampling="by_type"` (household): task j of iteration i has type
    types[((i - 1) * P + j) mod len(types)], the first seed of the iteration's random stream that
    has it, so the types take turns across the run and within each update.
    """
    rng = np.random.default_rng([int(config.seed), int(iteration), 17])
    hi = int(config.env.eval_seed_offset) if n_train is None else int(n_train)
    p = int(config.algo.tasks_per_iter)
    if config.algo.task_sampling == "uniform":
        return [int(s) for s in rng.choice(hi, size=p, replace=hi < p)]
    from rollout.envs.household_world import reachable_types, task_type_of

    lo, hi_len = int(config.env.horizon_min), int(config.env.horizon_max)
    types = reachable_types(lo, hi_len)
    want = [types[((int(iteration) - 1) * p + j) % len(types)] for j in range(p)]
    out: list[int] = []
    for t in want:
        for _ in range(100 * len(types) * 8):
            s = int(rng.integers(hi))
            if s not in out and task_type_of(s, lo, hi_len) == t:
                out.append(s)
                break
        else:
            raise ValueError(f"no training seed below {hi} has task type {t!r}")
    return out


def eval_tasks(config, n_eval: int | None) -> list[int]:
    n = int(config.eval.num_tasks)
    if n_eval is None:  # household: held-out seeds, disjoint from training seeds
        return list(range(int(config.env.eval_seed_offset), int(config.env.eval_seed_offset) + n))
    # Spread over the split: games are stored grouped by task type, so the first n are one type.
    return sorted({int(i) for i in np.linspace(0, n_eval - 1, num=min(n, n_eval))})


def rollout_config(config, eval_mode: bool = False) -> RolloutConfig:
    """The run's rollout settings. The per-step bar only with log.rollout_progress (on a terminal
    one redraw per step; in a log a line at most every 10 s), while the iteration bar keeps the rate
    and ETA."""
    cfg = RolloutConfig.from_config(config, eval_mode=eval_mode)
    return dataclasses.replace(cfg, progress=bool(config.log.progress and config.log.rollout_progress))


def advantage_params(config) -> AdvantageParams:
    a = config.algo
    return AdvantageParams(
        delta=a.delta,
        kappa=a.kappa,
        gamma=a.gamma,
        beacon_gamma=a.beacon_gamma,
        lam_strategy=a.lam_strategy,
        lam_seg=a.lam_seg,
        omega=a.omega,
        invalid_penalty=a.invalid_penalty,
        r_succ=a.r_succ,
        r_ms=a.r_ms,
        c_len=a.c_len,
        c_fmt=a.c_fmt,
        strategy_budget=float(a.strategy_budget),
        stats_over_steps=bool(a.stats_over_steps),
        gigpo_norm=a.gigpo_norm,
        seg_norm=a.seg_norm,
    )


def loss_dict(t) -> dict:
    return {
        "eps_low": t.eps_low,
        "eps_high": t.eps_high,
        "dual_clip": t.dual_clip,
        "kl_coef": t.kl_coef,
        "entropy_coef": t.entropy_coef,
        "aggregation": t.aggregation,
    }
