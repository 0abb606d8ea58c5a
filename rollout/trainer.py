"""The training loop behind `launch.py`: rollout -> advantages -> update, with evaluation,
checkpoints, exact resume, metrics and plots.

Determinism (what makes kill-and-resume exact): every random choice of iteration i (its task
seeds, the sampler's keys, the mini-batch order) is a pure function of (config.seed, i); the
checkpoint after iteration i holds the train state, and the run restarts at i + 1.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from rollout import report
from rollout.ablate import run_ablation
from rollout.evaluate import run_evals, task_types_of, timed_evals
from rollout.iteration import iteration_step
from rollout.progress import note, progress
from rollout.run import Run
from rollout.setup import eval_tasks, make_envs, make_mesh, num_tasks, trajectories_per_task
from rollout.warmstart import model_dir
from strata_jax.models.hf import export_hf


def _plots(workdir: pathlib.Path, history: list[dict], title: str) -> None:
    report.plot_learning_curves(history, workdir / "learning_curves.png", title)
    report.plot_success_by_horizon(history, workdir / "success_by_horizon.png", "eval")


class _NoLog:
    """The metrics log of a process other than 0: rows are computed (they are global) but only
    process 0 writes them."""

    history: list = []

    def truncate_after(self, iteration: int) -> None:
        pass

    def append(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _save_outcomes(run, workdir: pathlib.Path, iteration: int) -> None:
    """The latest evaluation's per-task outcomes, evals/iter_NNNNN.json: {prefix: {tasks, won, valid,
    horizon, temperature}}."""
    if run.lead and run.eval_outcomes:
        (workdir / "evals").mkdir(exist_ok=True)
        (workdir / "evals" / f"iter_{int(iteration):05d}.json").write_text(json.dumps(run.eval_outcomes))


def train(config, workdir) -> dict:
    workdir = pathlib.Path(workdir)
    # processes other than 0 print nothing (`_quiet`); loading the model takes a while
    note(f"{config.algo.name}: loading the model of {workdir}", enabled=bool(config.log.progress) and _alone(config))
    run = Run(config, workdir)
    log = report.MetricsLog(workdir) if run.lead else _NoLog()
    # A fresh run starts a fresh log; a resumed one drops rows past its checkpoint (redone now).
    log.truncate_after(run.start_iteration - 1 if run.start_iteration > 1 else -1)
    c = config
    n_train = num_tasks(c, c.env.split)
    n_eval = num_tasks(c, c.env.eval_split)
    # environments for one rollout shard (a process collects its shards one after the other)
    per_shard = c.algo.tasks_per_iter // run.shards * trajectories_per_task(c)
    envs = make_envs(c, per_shard, c.env.split)
    evaluating = bool(c.eval.every) and run.lead  # several processes: process 0 evaluates alone
    eval_envs = (
        make_envs(c, min(int(c.eval.num_tasks), n_eval or int(c.eval.num_tasks)), c.env.eval_split)
        if evaluating
        else None
    )
    etasks = eval_tasks(c, n_eval)
    types = task_types_of(c, etasks, c.env.eval_split) if evaluating else {}
    world = c.env.name
    if world == "doors" and int(c.env.doors_sign_at) > 0:  # the signpost corridor (configs/tiny_signs.py)
        world = f"the signpost corridor (sign at door {int(c.env.doors_sign_at) + 1})"
    revise = f" (strategy revised every {int(c.algo.revise_every)} steps)" if int(c.algo.revise_every) > 0 else ""
    title = f"{c.algo.name}{revise} on {world} ({workdir.name})"
    if not run.lead:
        c = _quiet(c)
    if run.start_iteration == 1 and evaluating and c.eval.at_start:
        note(f"evaluating the starting model on {len(etasks)} held-out tasks", enabled=c.log.progress)
        row = {"iteration": 0}
        row.update(timed_evals(run, eval_envs, etasks, types))
        _save_outcomes(run, workdir, 0)
        log.append(row)
        note(
            f"iteration 0: eval/success {row['eval/success']:.3f}"
            + (f", eval_greedy/success {row['eval_greedy/success']:.3f}" if c.eval.greedy else "")
            + f" ({row['time/eval_s']:.0f} s)",
            enabled=c.log.progress,
        )
    last = {}
    # One tick per iteration, with the run's rate and ETA: a bar on a terminal, a line at most
    # every 10 s in a log (rollout/progress.py).
    bar = progress(
        iterable=range(run.start_iteration, int(c.iterations) + 1),
        desc=f"{c.algo.name}",
        initial=run.start_iteration - 1,
        total=int(c.iterations),
        enabled=c.log.progress,
        unit="iter",
    )
    for it in bar:
        row, res = iteration_step(run, envs, it, n_train)
        if evaluating and (it % int(c.eval.every) == 0 or it == int(c.iterations)):
            bar.status(f"iteration {it}: evaluating on {len(etasks)} held-out tasks")
            row.update(timed_evals(run, eval_envs, etasks, types))
            _save_outcomes(run, workdir, it)
        if c.log.save_batches and run.lead:
            report.save_batch(workdir, it, res.traj, res.texts)
        log.append(row)
        # every process saves: orbax writes each process's own shards of the state
        if c.checkpoint.every and (it % int(c.checkpoint.every) == 0 or it == int(c.iterations)):
            run.ckpt.save(it, run.checkpoint_state(), extra={"iteration": it}, force=True)
        if c.log.plots_every and it % int(c.log.plots_every) == 0 and run.lead:
            _plots(workdir, log.history, title)
        bar.set_postfix(
            success=f"{row['train/success']:.2f}",
            ret=f"{row['train/episode_return']:.2f}",
            tok_s=f"{row['time/sample_tok_s']:.0f}",
            eval=f"{row.get('eval/success', float('nan')):.2f}",
        )
        last = row
    run.ckpt.wait()
    if run.lead:
        _plots(workdir, log.history, title)
    log.close()
    for pool in (envs, eval_envs):
        if hasattr(pool, "close"):
            pool.close()
    return last


def _alone(config) -> bool:
    """Whether a line may be printed before the Run exists: asking jax which process this is would
    start its backend before make_mesh starts jax.distributed, so a run on several processes
    prints from its Run on (process 0 only)."""
    return not bool(config.mesh.distributed)


def _quiet(config):
    """The config with progress output off (processes other than 0 print no bars)."""
    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.log.progress = False
    return config


def sft_only(config, workdir) -> None:
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    from rollout.warmstart import wants_sft

    if not wants_sft(config):
        raise ValueError("launch.py sft with config.sft.steps=0 and config.sft.read_steps=0 has nothing to do")
    # saved like a training run's, so bench/eval_dump.py and `launch.py eval` can read the workdir
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    path = model_dir(config, workdir, make_mesh(config))
    print(f"SFT model: {path}")


def evaluate_run(config, workdir) -> dict:
    workdir = pathlib.Path(workdir)
    # Lines from the start: loading a real model, restoring its checkpoint and the environments
    # take a while before the evaluation's own bar (rollout/evaluate.py) appears.
    shown = bool(config.log.progress) and _alone(config)
    note(f"eval: loading the model and the latest checkpoint of {workdir}", enabled=shown)
    run = Run(config, workdir, for_training=False)
    if not run.lead:  # several processes: process 0 evaluates alone (evaluate needs no collective)
        return {}
    n_eval = num_tasks(config, config.env.eval_split)
    tasks = eval_tasks(config, n_eval)
    note(f"eval: checkpoint of iteration {run.start_iteration - 1}; starting {len(tasks)} environments", enabled=shown)
    envs = make_envs(config, len(tasks), config.env.eval_split)
    types = task_types_of(config, tasks, config.env.eval_split)
    out = {"iteration": run.start_iteration - 1}
    out.update(run_evals(run, envs, tasks, types))
    (workdir / "eval.json").write_text(json.dumps(out, indent=2))
    _save_outcomes(run, workdir, out["iteration"])
    width = max(len(k) for k in out)
    for k, v in out.items():
        print(f"{k:<{width}}  {v:.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    return out


def export(config, workdir, out_dir) -> pathlib.Path:
    """The latest checkpoint's params in Hugging Face format (transformers loads it)."""
    workdir = pathlib.Path(workdir)
    run = Run(config, workdir, for_training=False)
    if run.nproc > 1:
        raise ValueError(
            "export runs on one process: drop --config.mesh.distributed (the checkpoint restores on any mesh)"
        )
    out = pathlib.Path(out_dir)
    # The model the sampler decodes (with LoRA, the adapters merged in) for anyone ...
    export_hf(run.decode_params(), dataclasses.replace(run.mcfg, lora_rank=0), run.tokenizer, out)
    print(f"exported iteration {run.start_iteration - 1} to {out}")
    if run.lora:  # ... and the adapters alone in PEFT's format, for `peft` over the base model
        from strata_jax import lora
        from strata_jax.models.hf import write_safetensors

        adapter = out / "adapter"
        adapter.mkdir(parents=True, exist_ok=True)
        write_safetensors(adapter / "adapter_model.safetensors", lora.peft_tensors(run.state.params, run.mcfg))
        (adapter / "adapter_config.json").write_text(
            json.dumps(lora.peft_config(run.mcfg, str(run.model_path)), indent=2)
        )
        print(f"PEFT adapter ({lora.count(run.state.params)} weights over {run.model_path}): {adapter}")
    return out


def ablate(config, workdir, grid: list[str]) -> pathlib.Path:
    return run_ablation(config, pathlib.Path(workdir), grid)
