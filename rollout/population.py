"""`launch.py ablate --train`: K trainings that differ only in traced hyper-parameters, as ONE
vmapped program.

    python launch.py ablate --train --config configs/tiny_household.py --workdir runs/pop \
        --grid delta=0.25,0.5 --grid kappa=0,0.1          # K = 4 copies

Every copy starts from the same model and optimiser state (the one a single `launch.py train` with
this config starts from). The train state is stacked on a leading [K] axis; each iteration

  1. rolls out each copy in turn with its own params (the Python rollout loop cannot be vmapped),
     with the task seeds and sampler keys that a separate run with the same seed uses;
  2. computes advantages and diagnostics vmapped over (TrajectoryBatch_k, AdvantageParams_k);
  3. updates vmapped over (TrainState_k, mini-batch_k): mini-batch j of the step stacks each copy's
     own j-th mini-batch (the same rows, in the same order, as its separate run), left-padded to a
     common width. A copy whose epoch has fewer mini-batches sits the extra steps out (its state,
     step counter and rng included, is kept as is).

So copy k follows its separate run `launch.py train --config.algo.<name>=<value_k>` step for step
(up to float reassociation: the vmapped program and the wider padding reorder some sums).

Outputs in the workdir: copies/<label>/metrics.jsonl (+ TensorBoard), one per copy, each row with a
`copy` column and the copy's grid values; population_curves.png (one line per copy);
population.json (the grid); population_checkpoints/ (the stacked state: a killed run resumes at
the iteration after its last checkpoint, exactly).

Only a grid over traced `AdvantageParams` leaves can share one program. Names that change shapes
or the algorithm (algo.name, num_strategies, group_size, ...) are refused with their name.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rollout import report
from rollout.ablate import LOSS_ONLY, SWEEPABLE, grid_points, parse_grid
from rollout.collect import collect
from rollout.evaluate import run_evals, task_types_of
from rollout.iteration import metrics_row
from rollout.progress import note, progress
from rollout.run import Run
from rollout.scoring import score_batch
from rollout.setup import (
    advantage_params,
    eval_tasks,
    loss_dict,
    make_envs,
    num_tasks,
    rollout_config,
    train_tasks,
    trajectories_per_task,
)
from strata_jax.advantages import compute_advantages, token_advantages
from strata_jax.batch import TokenBatch, check_window, has_signal, trim_rows
from strata_jax.checkpoint import Checkpointer
from strata_jax.diagnostics import compute_diagnostics
from strata_jax.sharding import replicated
from strata_jax.train import TrainState, loss_config, minibatches, train_state_shardings, train_step_fn

# Panels of population_curves.png: one line per copy.
CURVES = ("train/success", "eval/success", "train/episode_return", "train/esu", "train/car", "update/loss")
_TOKEN_FIELDS = ("tokens", "attention_mask", "loss_mask", "old_logp", "ref_logp", "advantage")


# --------------------------------------------------------------------------------------------
# the grid


def parse_train_grid(specs: list[str], algo: str | None = None) -> dict[str, list[float]]:
    """The grid of a population run; a name outside the traced advantage parameters is refused
    with its name (a different algorithm or shape is a different program, not a vmapped value)."""
    for spec in specs:
        name = spec.partition("=")[0].strip()
        if name and name not in SWEEPABLE + LOSS_ONLY:
            raise ValueError(
                f"--grid {name!r} cannot be trained as one vmapped population: only traced advantage "
                f"parameters can differ between copies ({list(SWEEPABLE + LOSS_ONLY)}); {name!r} changes the "
                "program (algorithm, shapes or rollout), so run separate `launch.py train` jobs for it"
            )
    return parse_grid(specs, SWEEPABLE + LOSS_ONLY, algo=algo)


def copy_label(point: dict) -> str:
    return ",".join(f"{k}={v:g}" for k, v in point.items())


def copy_configs(config, points: list[dict]) -> list:
    """The config a separate run of each copy would be given (`--config.algo.<name>=<value>`)."""
    from configs.base import ConfigError, validate

    out = []
    for p in points:
        c = copy.deepcopy(config)
        for k, v in p.items():
            c.algo[k] = float(v)
        try:
            validate(c)
        except ConfigError as e:
            raise ValueError(f"grid point {copy_label(p)}: {e}") from None
        out.append(c)
    return out


# --------------------------------------------------------------------------------------------
# memory: K copies of params + optimiser state (+ their gradients inside the step)


def tree_bytes(tree) -> int:
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def available_bytes(mesh) -> tuple[int, str]:
    """Memory the stacked state can use: the devices' limits summed (the state is sharded over the
    mesh), or the host's physical memory on CPU (where the devices share it)."""
    devices = list(mesh.devices.flat)
    stats = [d.memory_stats() if hasattr(d, "memory_stats") else None for d in devices]
    if all(s and s.get("bytes_limit") for s in stats):
        return int(sum(s["bytes_limit"] for s in stats)), f"{len(devices)} x {devices[0].device_kind}"
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "host RAM"


def check_memory(state: TrainState, k: int, available: int, where: str) -> dict:
    """Refuse a population whose state cannot fit; returns the arithmetic.

    Resident: K x (params + optimiser state) for the stacked state, plus K x params of gradients
    while a step runs, plus one reference copy of the params (the KL anchor, shared). With LoRA
    the stacked params are the adapters, and the frozen base is held once with one merged copy
    for the sampler (the reference is the base itself). Activations
    come on top (K x one copy's: the mini-batch is per copy), so this is a lower bound: a run it
    refuses cannot work; one it admits may still run out on activations (lower mini_batch_rows or
    raise micro_batches then).
    """
    p, o = tree_bytes(state.params), tree_bytes(state.opt_state)
    frozen = getattr(state, "frozen", None)
    shared = p if frozen is None else 2 * tree_bytes(frozen)
    need = k * (p + o + p) + shared
    arith = {
        "copies": k,
        "params_bytes": p,
        "opt_state_bytes": o,
        "shared_bytes": shared,
        "needed_bytes": need,
        "available_bytes": available,
    }
    if need > available:
        gib = 2.0**30
        what = "reference params" if frozen is None else "frozen base + its merged decode copy"
        raise MemoryError(
            f"population of K={k} copies cannot fit in {where} ({available / gib:.1f} GiB): K x (params "
            f"{p / gib:.2f} + optimiser state {o / gib:.2f} + gradients {p / gib:.2f} GiB) + {what} "
            f"{shared / gib:.2f} GiB = {need / gib:.1f} GiB before activations; use fewer grid points"
        )
    return arith


# --------------------------------------------------------------------------------------------
# stacking


def stacked_shardings(single: Any, mesh) -> Any:
    """The single-copy NamedShardings with the copy axis [K] prepended, unsharded: a copy lives on
    the same devices, split the same way, as its separate run's state."""
    return jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(None, *s.spec)), single)


def slice_copy(tree: Any, k: int) -> Any:
    return jax.tree.map(lambda x: x[k], tree)


def pad_width(mb: TokenBatch, width: int, pad_id: int) -> TokenBatch:
    """Left-pad the [S, L] fields to `width` columns: masked padding, as rows are already left-padded,
    so positions (cumsum of the mask), the loss (sum, count) and the gradient are unchanged."""
    extra = width - mb.tokens.shape[1]
    if extra == 0:
        return mb
    out = {}
    for f in _TOKEN_FIELDS:
        x = np.asarray(getattr(mb, f))
        fill = pad_id if f == "tokens" else 0
        out[f] = np.concatenate([np.full((x.shape[0], extra), fill, x.dtype), x], axis=1)
    return mb.replace(**out)


def idle_batch(like: TokenBatch, width: int, pad_id: int) -> TokenBatch:
    """An all-padding mini-batch for a copy whose epoch has ended (its step result is discarded)."""
    s = like.tokens.shape[0]
    out = {f: np.zeros((s, width), np.asarray(getattr(like, f)).dtype) for f in _TOKEN_FIELDS}
    out["tokens"][:] = pad_id
    return TokenBatch(**out, row_index=np.zeros_like(like.row_index), row_valid=np.zeros_like(like.row_valid))


def stack_batches(batches: list) -> Any:
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *batches)


def copy_step(step_fn):
    """One copy's step `(state, batch, lam, active) -> (state, metrics)` from train.train_step_fn,
    to vmap over [K]: a copy past the end of its epoch (active False) keeps its state exactly, step
    counter and rng too, as its separate run makes no such step."""

    def one(state, batch, lam, active, frozen=None):
        # LoRA: the frozen base is shared by every copy (vmapped with in_axes None), never stacked
        new, metrics = step_fn(state.replace(frozen=frozen), batch, lam)
        new = new.replace(frozen=None)
        return jax.tree.map(lambda a, b: jnp.where(active, a, b), new, state), metrics

    return one


# --------------------------------------------------------------------------------------------
# the population


class Population:
    """K copies of a Run's train state on a leading axis, their vmapped update and checkpoints."""

    def __init__(self, config, workdir: pathlib.Path, specs: list[str]):
        if jax.process_count() > 1:
            raise ValueError(
                "ablate --train runs in one process (the copies' rollouts are a host loop); "
                f"got jax.process_count()={jax.process_count()}"
            )
        if float(config.train.ptx_coef) > 0 or not config.train.rl_update:
            raise ValueError(
                "ablate --train has no ptx steps (config.train.ptx_coef / rl_update): its vmapped "
                "update is the policy loss alone; run ptx as separate `launch.py` runs"
            )
        self.grid = parse_train_grid(specs, config.algo.name)
        self.workdir = pathlib.Path(workdir)
        self.config = config
        self.points, self.adv_params = grid_points(advantage_params(config), self.grid)
        self.labels = [copy_label(p) for p in self.points]
        self.configs = copy_configs(config, self.points)
        self.k = len(self.points)
        self._check_grid_file()
        run = self.run = Run(config, self.workdir, for_training=False)
        if getattr(run, "shards", 1) != 1:
            raise ValueError(
                "ablate --train collects each copy's rollouts as one shard; "
                f"config.mesh.rollout_shards gives {run.shards}: set it to 1"
            )
        if run.start_iteration != 1:
            raise ValueError(
                f"{self.workdir} holds a single run's checkpoints ({run.ckpt.directory}); a population "
                "starts from the run's starting model, so give it its own --workdir"
            )
        mesh = run.mesh
        self.memory = check_memory(run.state, self.k, *available_bytes(mesh))
        # With LoRA the copies stack their adapters only, over one frozen base (TrainState.frozen).
        self.frozen, single = run.state.frozen, run.state.replace(frozen=None)
        self.frozen_sh = None if self.frozen is None else train_state_shardings(run.state, mesh).frozen
        single_sh = train_state_shardings(single, mesh)
        self.param_sh = single_sh.params
        self.state_sh = stacked_shardings(single_sh, mesh)
        k = self.k
        self.state = jax.jit(
            lambda s: jax.tree.map(lambda x: jnp.broadcast_to(x[None], (k, *x.shape)), s), out_shardings=self.state_sh
        )(single)
        run.state = None  # the stacked copies replace it
        self.ckpt = Checkpointer(
            self.workdir / "population_checkpoints",
            save_every=1,
            keep=int(config.checkpoint.keep),
            async_save=bool(config.checkpoint.async_save),
        )
        self.start_iteration = 1
        abstract = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), self.state, self.state_sh
        )
        restored = self.ckpt.restore_latest(abstract)
        if restored is not None:
            self.state, extra = restored
            if extra.get("labels") != self.labels:
                raise ValueError(
                    f"population checkpoint in {self.ckpt.directory} is of the grid "
                    f"{extra.get('labels')}, not {self.labels}"
                )
            self.start_iteration = int(extra["iteration"]) + 1
        # lam_strategy weights the strategy rows in the loss too: each copy passes its own.
        self.lam = np.asarray([float(c.algo.lam_strategy) for c in self.configs], np.float32)  # [K]
        self._adv = jax.jit(jax.vmap(self._adv_one, in_axes=(0, 0)))
        self._step = self._build_step()

    def _check_grid_file(self) -> None:
        path = self.workdir / "population.json"
        info = {"grid": self.grid, "labels": self.labels}
        if path.exists():
            old = json.loads(path.read_text())
            if old.get("labels") != self.labels:
                raise ValueError(
                    f"{path} records the grid {old.get('labels')}; this run asks for {self.labels}: "
                    "use another --workdir"
                )
        self.workdir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(info, indent=1))

    def _adv_one(self, traj, params):
        adv = compute_advantages(traj, params, self.config.algo.name)
        return adv, compute_diagnostics(traj, adv)

    def _build_step(self):
        """The vmapped update. It runs unshared: `train.shared_prefix` and `train.prefix_tree_update`
        pack each copy's rows differently (prefix counts, lengths, packed rows), so the copies'
        packed batches could not be stacked; the copies' scoring shares (score_batch, with
        `train.prefix_tree` as trees). Same update up to float rounding either way."""
        c, run = self.config, self.run
        t = c.train
        step_fn = train_step_fn(
            run.graphdef,
            run.optimizer,
            loss_config(loss_dict(t)),
            run.mesh,
            micro_batches=int(t.micro_batches),
            logprob_chunk=int(t.logprob_chunk),
            logprob_window=run.window,
        )
        repl = replicated(run.mesh)
        batch_sh = NamedSharding(run.mesh, PartitionSpec(None, ("data", "fsdp")))  # [K, S, ...]: rows split
        step = jax.jit(
            jax.vmap(copy_step(step_fn), in_axes=(0, 0, 0, 0, None)),
            in_shardings=(self.state_sh, batch_sh, repl, repl, self.frozen_sh),
            out_shardings=(self.state_sh, repl),
            donate_argnums=(0,),
        )
        return lambda state, batch, lam, active: step(state, batch, lam, active, self.frozen)

    def copy_params(self, k: int):
        """Copy k's trained params (with LoRA its adapters)."""
        return jax.device_put(slice_copy(self.state.params, k), self.param_sh)

    def copy_state(self, k: int) -> TrainState:
        """Copy k as a train state for scoring and sampling (no optimiser state), the base shared."""
        return TrainState(
            params=self.copy_params(k), opt_state=None, step=None, rng=None, skipped=None, frozen=self.frozen
        )

    def view(self, k: int) -> Run:
        """Copy k as a Run for evaluate.evaluate: the shared model, policy and mesh (a shallow copy),
        with the copy's config and params."""
        v = copy.copy(self.run)
        v.config = self.configs[k]
        v.state = self.copy_state(k)
        return v

    # ----------------------------------------------------------------------------------------

    def rollout(self, k: int, envs, iteration: int, n_train: int | None):
        """Copy k's rollout and scores: iteration.iteration_step's first half with copy k's params."""
        run, cfg = self.run, self.configs[k]
        t0 = time.perf_counter()
        run.state = self.copy_state(k)  # copy k's params (the scoring's reference reads them too)
        run.sync_policy()  # the sampler's params: copy k's (with LoRA, merged into the base)
        run.policy.reseed(int(cfg.seed), iteration)
        # the sampling settings are the same for every copy
        Run.set_temperature(run, cfg.sampling.temperature, cfg.sampling.strategy_temperature)
        tok0, s0 = run.policy.tokens_generated, run.policy.sample_seconds
        res = collect(envs, run.policy, train_tasks(cfg, iteration, n_train), rollout_config(cfg))
        times = {"rollout": time.perf_counter() - t0}
        t1 = time.perf_counter()
        tb = score_batch(run, res.tokens, run.state.model_params)  # train.recompute_old_logp: the same for every copy
        times["score"] = time.perf_counter() - t1
        sample_tok_s = (run.policy.tokens_generated - tok0) / max(run.policy.sample_seconds - s0, 1e-9)
        return res, tb, times, sample_tok_s

    def iteration(self, envs, iteration: int, n_train: int | None, status=None) -> tuple[list[dict], list]:
        """One population iteration -> (one metrics row per copy, the copies' rollout results)."""
        k_all = range(self.k)
        t0 = time.perf_counter()
        outs = []
        for k in k_all:
            if status:
                status(f"copy {k + 1}/{self.k} rollout")
            outs.append(self.rollout(k, envs, iteration, n_train))
        shapes = {tuple(o[0].traj.shape) for o in outs}
        if len(shapes) != 1:
            raise ValueError(f"copies produced TrajectoryBatches of different shapes {sorted(shapes)}")

        t2 = time.perf_counter()
        trajs = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *[o[0].traj for o in outs])
        adv, diag = self._adv(trajs, self.adv_params)  # [K, ...]
        tbs = [
            token_advantages(
                outs[k][0].traj,
                jax.tree.map(lambda x, k=k: x[k], adv),
                outs[k][1],
                jax.tree.map(lambda x, k=k: x[k], self.adv_params),
                str(self.config.train.step_weighting),
            )
            for k in k_all
        ]
        diag = jax.device_get(diag)
        adv_s = time.perf_counter() - t2

        if status:
            status("update")
        t3 = time.perf_counter()
        sums, n_steps, no_signal = self.update(tbs, iteration)
        update_s = time.perf_counter() - t3
        skipped = np.asarray(jax.device_get(self.state.skipped))

        rows = []
        for k in k_all:
            res, tb, times, sample_tok_s = outs[k]
            row = {"iteration": iteration, "copy": k, **{f"grid/{n}": v for n, v in self.points[k].items()}}
            row.update(
                metrics_row(
                    res,
                    slice_copy(diag, k),
                    sums[k],
                    n_steps[k],
                    no_signal[k],
                    float(skipped[k]),
                    judgment=bool(self.config.algo.judgment),
                )
            )
            row["time/sample_tok_s"] = sample_tok_s
            row["time/rollout_s"], row["time/score_s"] = times["rollout"], times["score"]
            # shared by all copies: one vmapped call each
            row["time/advantages_s"], row["time/update_s"] = adv_s, update_s
            row["time/train_tok_s"] = float(np.asarray(tb.attention_mask).sum()) / max(update_s, 1e-9)
            row["time/iteration_s"] = time.perf_counter() - t0
            rows.append(row)
        return rows, [o[0] for o in outs]

    def update(self, tbs: list[TokenBatch], iteration: int) -> tuple[list[dict], list[int], list[int]]:
        """One epoch per copy, vmapped: step j stacks each copy's own j-th mini-batch."""
        c, run = self.config, self.run
        rows = int(c.train.mini_batch_rows)
        seed = int(c.seed) * 100003 + iteration  # iteration.iteration_step's mini-batch order
        mbs = []
        for tb in tbs:
            own = []
            for mb in minibatches(jax.tree.map(np.asarray, tb), rows, seed=seed):
                mb = trim_rows(mb, c.train.length_buckets)
                check_window(np.asarray(mb.loss_mask), run.window)
                own.append(mb)
            mbs.append(own)
        sums: list[dict] = [{} for _ in tbs]
        n_steps = [0] * len(tbs)
        no_signal = [0] * len(tbs)
        for j in range(max(len(m) for m in mbs)):
            width = max(m[j].tokens.shape[1] for m in mbs if j < len(m))
            # a copy past its epoch, or (train.skip_no_signal) on a mini-batch without signal, keeps
            # its state, as its separate run would (iteration.iteration_step)
            silent = np.asarray([j < len(m) and c.train.skip_no_signal and not has_signal(m[j]) for m in mbs])
            active = np.asarray([j < len(m) for m in mbs]) & ~silent
            for k in np.flatnonzero(silent):
                no_signal[k] += 1
            batch = stack_batches(
                [pad_width(m[j], width, run.pad_id) if j < len(m) else idle_batch(m[0], width, run.pad_id) for m in mbs]
            )
            self.state, metrics = self._step(self.state, batch, self.lam, active)
            metrics = jax.device_get(metrics)
            for k in np.flatnonzero(active):
                n_steps[k] += 1
                for name, v in metrics.items():
                    sums[k][name] = sums[k].get(name, 0.0) + float(np.asarray(v)[k])
        return sums, n_steps, no_signal

    def evals(self, eval_envs, etasks, types) -> list[dict]:
        out = []
        for k in range(self.k):
            t0 = time.perf_counter()
            row = run_evals(self.view(k), eval_envs, etasks, types)
            row["time/eval_s"] = time.perf_counter() - t0
            out.append(row)
        return out


# --------------------------------------------------------------------------------------------
# entry point


def train_population(config, workdir, specs: list[str]) -> list[dict]:
    """Train the population; returns each copy's last metrics row."""
    workdir = pathlib.Path(workdir)
    pop = Population(config, workdir, specs)
    c = config
    logs = []
    for label in pop.labels:
        log = report.MetricsLog(workdir / "copies" / label)
        log.truncate_after(pop.start_iteration - 1 if pop.start_iteration > 1 else -1)
        logs.append(log)
    n_train = num_tasks(c, c.env.split)
    n_eval = num_tasks(c, c.env.eval_split)
    per_iter = c.algo.tasks_per_iter * trajectories_per_task(c)
    envs = make_envs(c, per_iter, c.env.split)
    eval_envs = (
        make_envs(c, min(int(c.eval.num_tasks), n_eval or int(c.eval.num_tasks)), c.env.eval_split)
        if c.eval.every
        else None
    )
    etasks = eval_tasks(c, n_eval)
    types = task_types_of(c, etasks, c.env.eval_split) if c.eval.every else {}
    title = f"{c.algo.name} on {c.env.name}: population of {pop.k} ({workdir.name})"
    gb = 2.0**30
    m = pop.memory
    note(
        f"population: {pop.k} copies ({'; '.join(pop.labels)}); state {pop.k} x "
        f"{(m['params_bytes'] + m['opt_state_bytes']) / gb:.3f} GiB",
        enabled=c.log.progress,
    )
    if pop.start_iteration == 1 and c.eval.every:
        # Every copy starts from the same model: one evaluation serves all (a separate run makes
        # the same one, with the same sampler keys).
        t0 = time.perf_counter()
        row = run_evals(pop.view(0), eval_envs, etasks, types)
        row["time/eval_s"] = time.perf_counter() - t0
        for k, log in enumerate(logs):
            log.append({"iteration": 0, "copy": k, **{f"grid/{n}": v for n, v in pop.points[k].items()}, **row})
    last: list[dict] = []
    bar = progress(
        iterable=range(pop.start_iteration, int(c.iterations) + 1),
        desc=f"population K={pop.k}",
        initial=pop.start_iteration - 1,
        total=int(c.iterations),
        enabled=c.log.progress,
        unit="iter",
    )
    status = bar.status if c.log.progress else None  # the phase: a copy's rollout, the update, the evaluation
    for it in bar:
        rows, results = pop.iteration(envs, it, n_train, status)
        if c.eval.every and (it % int(c.eval.every) == 0 or it == int(c.iterations)):
            if status:
                status(f"evaluating {pop.k} copies on {len(etasks)} held-out tasks")
            for row, ev in zip(rows, pop.evals(eval_envs, etasks, types)):
                row.update(ev)
        for k, (row, log) in enumerate(zip(rows, logs)):
            if c.log.save_batches:
                report.save_batch(log.dir, it, results[k].traj, results[k].texts)
            log.append(row)
        if c.checkpoint.every and (it % int(c.checkpoint.every) == 0 or it == int(c.iterations)):
            pop.ckpt.save(it, pop.state, extra={"iteration": it, "labels": pop.labels}, force=True)
        if c.log.plots_every and it % int(c.log.plots_every) == 0:
            report.plot_population(
                [log.history for log in logs], pop.labels, workdir / "population_curves.png", CURVES, title
            )
        bar.set_postfix_str(" ".join(f"[{k}] s={r['train/success']:.2f}" for k, r in enumerate(rows)))
        last = rows
    pop.ckpt.wait()
    report.plot_population([log.history for log in logs], pop.labels, workdir / "population_curves.png", CURVES, title)
    for log in logs:
        log.close()
    for pool in (envs, eval_envs):
        if hasattr(pool, "close"):
            pool.close()
    return last
