"""The training loop behind `launch.py`: rollout -> advantages -> update, with evaluation,
checkpoints, exact resume, metrics and plots.

Determinism (what makes kill-and-resume exact): every random choice of iteration i (its task
seeds, the sampler's keys, the mini-batch order) is a pure function of (config.seed, i); the
checkpoint after iteration i holds the train state, and the run restarts at i + 1.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from rollout import report
from rollout.collect import RolloutConfig, collect
from rollout.judge import judge_quality_row
from rollout.jax_policy import JaxPolicy
from rollout.shards import merge_results, process_shards, shard_tasks, to_host
from strata_jax import sharding
from strata_jax.advantages import compute_advantages, invalid_penalty
from strata_jax.advantages.params import AdvantageParams
from strata_jax.advantages.weighting import step_weights
from strata_jax.batch import TokenBatch, TrajectoryBatch, gather_advantages, pad_token_rows
from strata_jax.checkpoint import Checkpointer
from strata_jax.diagnostics import compute_diagnostics
from strata_jax.models.hf import export_hf, load_hf_model, load_tokenizer
from strata_jax.sft import make_sft_step
from strata_jax.train import (abstract_train_state, init_train_state, loss_config, make_optimizer,
                              make_train_step, minibatches, optimizer_config, sequence_logprobs)

BUCKETS = ("short", "medium", "long")


# --------------------------------------------------------------------------------------------
# set-up: mesh, model directory (tiny model + SFT when no path is given), environments


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


def env_kwargs(config, split: str | None = None) -> dict:
    e = config.env
    if e.name in ("household", "shop", "doors"):
        from rollout.demos import expert_env_kwargs

        return expert_env_kwargs(config)
    if e.name == "alfworld":
        return {"data_dir": str(e.data_dir), "split": split or e.split, "max_steps": int(e.max_steps),
                "milestones": config.algo.milestones, "cache_dir": str(e.cache_dir) or None}
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
    if config.env.name in ("household", "shop", "doors"):  # procedural: held-out tasks are seeds past eval_seed_offset
        return None
    from rollout.envs import make_env

    env = make_env(config.env.name, **env_kwargs(config, split))
    n = getattr(env, "num_tasks", None)
    if hasattr(env, "close"):
        env.close()
    return n


def train_tasks(config, iteration: int, n_train: int | None) -> list[int]:
    """The P task seeds of an iteration: a pure function of (seed, iteration)."""
    rng = np.random.default_rng([int(config.seed), int(iteration), 17])
    hi = int(config.env.eval_seed_offset) if n_train is None else int(n_train)
    return [int(s) for s in rng.choice(hi, size=int(config.algo.tasks_per_iter), replace=hi < config.algo.tasks_per_iter)]


def eval_tasks(config, n_eval: int | None) -> list[int]:
    n = int(config.eval.num_tasks)
    if n_eval is None:  # household: held-out seeds, disjoint from training seeds
        return list(range(int(config.env.eval_seed_offset), int(config.env.eval_seed_offset) + n))
    # Spread over the split: games are stored grouped by task type, so the first n are one type.
    return sorted({int(i) for i in np.linspace(0, n_eval - 1, num=min(n, n_eval))})


def model_dir(config, workdir: pathlib.Path, mesh) -> pathlib.Path:
    """The HF directory the run starts from: config.model.path, else the tiny model after SFT."""
    if config.model.path:
        path = pathlib.Path(config.model.path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"config.model.path={str(path)!r} has no config.json: not a model directory")
        return path
    if jax.process_count() > 1:
        # Building it would mean one process training the SFT model while the others wait in a
        # collective, and every process writing the same workdir files.
        raise ValueError("a run on several processes needs config.model.path: build the tiny SFT model "
                         "first on one process (`python launch.py sft ...`) and pass its sft_model directory")
    sft_dir = workdir / "sft_model"
    if (sft_dir / "config.json").exists():
        return sft_dir
    init_dir = workdir / "tiny_init"
    if not (init_dir / "config.json").exists():
        from rollout.demos import corpus
        from strata_jax.models.tiny import make_tiny_model

        m = config.model
        make_tiny_model(init_dir, texts=corpus(config), vocab_size=int(m.tiny_vocab), hidden_size=int(m.tiny_hidden),
                        layers=int(m.tiny_layers), heads=int(m.tiny_heads), kv_heads=int(m.tiny_kv_heads),
                        intermediate_size=int(m.tiny_intermediate), seed=int(config.seed))
    if config.sft.steps <= 0:
        return init_dir
    run_sft(config, init_dir, sft_dir, mesh)
    return sft_dir


# --------------------------------------------------------------------------------------------
# SFT warm start


def _read_jsonl_demos(path: str, tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rows from a JSONL file of {"messages": [chat messages], "response": "..."}."""
    from rollout.policy import render

    rows = []
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            if not isinstance(d, dict) or "messages" not in d or "response" not in d:
                raise ValueError(f"{path}:{ln}: each line needs 'messages' (chat list) and 'response' (str)")
            p = tokenizer.encode(render(d["messages"], tokenizer), add_special_tokens=False)
            r = tokenizer.encode(d["response"], add_special_tokens=False)
            rows.append((np.asarray(p, np.int32), np.asarray(r, np.int32)))
    return rows


def run_sft(config, init_dir: pathlib.Path, out_dir: pathlib.Path, mesh) -> None:
    """Next-token training on expert rows, then export to `out_dir` (HF format)."""
    from rollout.demos import sft_rows

    (graphdef, params), mcfg = load_hf_model(init_dir, dtype=config.model.dtype,
                                             param_dtype=config.model.param_dtype, mesh=mesh, split=True)
    tok = load_tokenizer(init_dir)
    if config.sft.demos:
        rows = _read_jsonl_demos(config.sft.demos, tok)
    elif config.env.name in ("household", "shop", "doors") or not config.model.path:
        rows = sft_rows(config, tok, range(int(config.sft.num_tasks)), float(config.sft.judge_share))
    else:
        raise ValueError("config.sft.demos is empty: SFT on this environment needs demonstrations as JSONL")
    groups = length_groups([len(p) + len(r) for p, r in rows], config.train.length_buckets)
    # Every row ends with its response, so the head only runs on the last `window` columns.
    window = max(len(r) for _, r in rows)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(optax.warmup_cosine_decay_schedule(0.0, float(config.sft.lr), 20,
                                                                     max(int(config.sft.steps), 21)),
                                  weight_decay=0.0))
    opt_state = opt.init(params)
    step = make_sft_step(graphdef, opt, int(config.train.logprob_chunk), window=window)
    rng = np.random.default_rng(int(config.seed) + 7)
    b = int(config.sft.batch_rows)
    bar = tqdm(range(int(config.sft.steps)), desc="sft", disable=not config.log.progress, dynamic_ncols=True)
    loss = float("nan")
    for _ in bar:
        length, idx = sft_batch(groups, b, rng)
        pk = pad_token_rows([rows[i][0] for i in idx], [rows[i][1] for i in idx],
                            [np.zeros(len(rows[i][1]), np.float32) for i in idx], length, b,
                            pad_id=int(tok.pad_token_id or 0))
        params, opt_state, loss = step(params, opt_state, pk["tokens"], pk["attention_mask"], pk["loss_mask"])
        bar.set_postfix(loss=f"{float(loss):.3f}", length=length)
    export_hf(params, mcfg, tok, out_dir)
    (out_dir / "sft_info.json").write_text(json.dumps({"rows": len(rows), "steps": int(config.sft.steps),
                                                       "final_loss": float(loss)}))


def length_groups(lengths, buckets) -> dict[int, np.ndarray]:
    """Row indices by the smallest length bucket holding them: {bucket: indices}."""
    lengths = np.asarray(lengths)
    edges = np.asarray(sorted(int(b) for b in buckets))
    if lengths.max(initial=0) > edges[-1]:
        raise ValueError(f"an SFT row of {int(lengths.max())} tokens exceeds the largest "
                         f"train.length_buckets ({int(edges[-1])})")
    which = np.searchsorted(edges, lengths)  # first bucket >= length
    return {int(edges[k]): np.flatnonzero(which == k) for k in np.unique(which)}


def sft_batch(groups: dict[int, np.ndarray], b: int, rng: np.random.Generator) -> tuple[int, np.ndarray]:
    """(length, row indices) of one SFT batch: a bucket drawn in proportion to its rows, then `b`
    of its rows. A batch of one bucket pads to that bucket, not to the longest row of the corpus:
    attention on a small CPU model costs ~ length^2, so mixed batches would pay for the longest."""
    keys = sorted(groups)
    sizes = np.asarray([len(groups[k]) for k in keys], np.float64)
    k = keys[int(rng.choice(len(keys), p=sizes / sizes.sum()))]
    g = groups[k]
    return k, g[rng.choice(len(g), size=b, replace=len(g) < b)]


# --------------------------------------------------------------------------------------------
# the run: everything one training or evaluation needs


class Run:
    """Model, policy, update and checkpoints of one workdir."""

    def __init__(self, config, workdir: pathlib.Path, for_training: bool = True):
        self.config, self.workdir = config, pathlib.Path(workdir)
        self.mesh = make_mesh(config)  # first: jax.distributed must start before devices are touched
        self.nproc, self.rank = jax.process_count(), jax.process_index()
        self.lead = self.rank == 0  # the one process that writes run files (metrics, plots, batches)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.lead:
            (self.workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
        self.shards = rollout_shards(config)
        self.my_shards = process_shards(self.shards, self.rank, self.nproc)
        # Each process samples on its own devices with a local copy of the params, so a rollout
        # never waits on another host (docs/TPU.md); one process samples on the global mesh.
        self.local_mesh = self.mesh if self.nproc == 1 else sharding.local_mesh(int(config.mesh.tensor))
        self.model_path = model_dir(config, self.workdir, self.mesh)
        (graphdef, params), self.mcfg = load_hf_model(
            self.model_path, dtype=config.model.dtype, param_dtype=config.model.param_dtype, mesh=self.mesh,
            scan_layers=bool(config.model.scan_layers), remat=bool(config.model.remat), split=True)
        self.graphdef = graphdef
        self.tokenizer = load_tokenizer(self.model_path)
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        # The reference policy is the starting model; params are donated by the update, so copy.
        self.ref_params = jax.tree.map(jnp.copy, params)
        t = config.train
        ocfg = optimizer_config({"lr": t.lr, "weight_decay": t.weight_decay, "grad_clip": t.grad_clip,
                                 "schedule": t.schedule, "warmup_steps": t.warmup_steps})
        self.optimizer = make_optimizer(ocfg, total_steps=None)
        self.state = init_train_state(graphdef, params, self.optimizer, int(config.seed), self.mesh)
        self.ckpt = Checkpointer(self.workdir / "checkpoints", save_every=1, keep=int(config.checkpoint.keep),
                                 async_save=bool(config.checkpoint.async_save))
        self.start_iteration = 1
        restored = self.ckpt.restore_latest(abstract_train_state(self.state.params, self.optimizer, self.mesh))
        if restored is not None:
            self.state, extra = restored
            self.start_iteration = int(extra["iteration"]) + 1
        s = config.sampling
        budgets = {"strategy": s.max_strategy_tokens, "action": s.max_action_tokens, "judge": s.max_judge_tokens}
        self._synced = None
        self.policy = JaxPolicy(graphdef, self._policy_params(), self.tokenizer, budgets,
                                prompt_buckets=s.prompt_buckets, batch_buckets=s.batch_buckets,
                                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, mesh=self.local_mesh,
                                cache_dtype=s.kv_dtype, seed=int(config.seed))
        self.window = logprob_window(config)
        if for_training:
            self.train_step = make_train_step(graphdef, self.optimizer, loss_config(_loss_dict(t)), self.mesh,
                                              micro_batches=int(t.micro_batches), logprob_chunk=int(t.logprob_chunk),
                                              logprob_window=self.window)
        self.adv_params = advantage_params(config)

    def _policy_params(self):
        """The sampler's params for the current train state. Several processes: a local replica
        gathered from every process's shards (a collective; see sync_policy)."""
        self._synced = self.state
        if self.nproc == 1:
            return self.state.params
        return sharding.shard_params(sharding.fetch_global(self.state.params), self.local_mesh)

    def sync_policy(self) -> None:
        """Point the sampler at the current train state. With several processes every process must
        call this at the same point (it gathers the params); it is a no-op when nothing changed,
        which is what lets process 0 evaluate alone right after a synced update."""
        if self._synced is not self.state:
            self.policy.params = self._policy_params()
        elif self.nproc == 1:
            self.policy.params = self.state.params

    def set_temperature(self, temperature: float, strategy_temperature: float | None = None) -> None:
        """Sampling temperature of every call kind; strategy calls get their own when given (>= 0)."""
        from strata_jax.sampling import SamplingParams

        s = self.config.sampling
        self.policy.sampling = SamplingParams(temperature=float(temperature), top_p=s.top_p, top_k=s.top_k)
        self.policy.kind_sampling = {}
        if strategy_temperature is not None and strategy_temperature >= 0:
            self.policy.kind_sampling["strategy"] = SamplingParams(
                temperature=float(strategy_temperature), top_p=s.top_p, top_k=s.top_k)


def rollout_shards(config) -> int:
    """Shards an iteration's P tasks are collected in (config.mesh.rollout_shards, 0 = one per
    process). Checked here as well as in validate(): the process count may be auto-detected."""
    shards = int(config.mesh.rollout_shards) or jax.process_count()
    p = int(config.algo.tasks_per_iter)
    if shards % jax.process_count():
        raise ValueError(f"config.mesh.rollout_shards={shards} must be a multiple of the {jax.process_count()} "
                         "processes: every process collects whole shards")
    if p % shards:
        raise ValueError(f"config.algo.tasks_per_iter={p} must divide by the {shards} rollout shards "
                         f"({jax.process_count()} processes, config.mesh.rollout_shards="
                         f"{int(config.mesh.rollout_shards)}): each shard collects P / shards tasks")
    return shards


def _loss_dict(t) -> dict:
    return {"eps_low": t.eps_low, "eps_high": t.eps_high, "dual_clip": t.dual_clip, "kl_coef": t.kl_coef,
            "entropy_coef": t.entropy_coef, "aggregation": t.aggregation}


def advantage_params(config) -> AdvantageParams:
    a = config.algo
    return AdvantageParams(delta=a.delta, kappa=a.kappa, gamma=a.gamma, beacon_gamma=a.beacon_gamma,
                           lam_strategy=a.lam_strategy, lam_seg=a.lam_seg, omega=a.omega,
                           invalid_penalty=a.invalid_penalty, r_succ=a.r_succ, r_ms=a.r_ms, c_len=a.c_len,
                           c_fmt=a.c_fmt, strategy_budget=float(a.strategy_budget),
                           stats_over_steps=bool(a.stats_over_steps), gigpo_norm=a.gigpo_norm, seg_norm=a.seg_norm)


_compute_advantages = jax.jit(compute_advantages, static_argnames=("algo",))
_gather = jax.jit(gather_advantages)


def token_advantages(traj: TrajectoryBatch, adv, tb: TokenBatch, adv_params: AdvantageParams,
                     step_weighting: str = "step") -> TokenBatch:
    """The rollout's TokenBatch with each token's advantage filled in: the invalid penalty on the
    tokens collect marked (TokenBatch.penalty_mask), the step / strategy advantage on the rest,
    step rows scaled by their weight (`train.step_weighting`, strata_jax/advantages/weighting.py).
    The mask is dropped afterwards: the update reads only `advantage`."""
    tb = jax.tree.map(jnp.asarray, tb)
    w = step_weights(traj, step_weighting)  # [P, N, M, H]
    tb = _gather(adv.step * w, adv.strategy, tb, invalid_penalty(traj, adv_params) * w, adv.revision, adv.judge)
    return tb.replace(penalty_mask=None)


def has_signal(mb: TokenBatch) -> bool:
    """A mini-batch whose loss tokens all have advantage 0 carries no outcome signal: a step on it
    would be the KL and weight-decay terms alone, which AdamW's normalisation turns into a step of
    about lr per parameter (issue #13: ~0.1 nats of drift per row per iteration). Skipped."""
    return bool(np.any(np.asarray(mb.advantage)[np.asarray(mb.loss_mask) & np.asarray(mb.row_valid)[:, None]] != 0))


def trim_width(mask: np.ndarray, buckets) -> int:
    """The smallest length bucket holding every row of `mask` [S, L] (rows are left-padded, so the
    last `width` columns carry all tokens). Cutting a mini-batch to it saves the padding compute."""
    need = int(mask.sum(axis=1).max(initial=1))
    return next((int(b) for b in sorted(buckets) if b >= need), mask.shape[1])


def trim_rows(tb: TokenBatch, buckets) -> TokenBatch:
    """The [S, L] fields cut to the mini-batch's own length bucket (row_index / row_valid kept)."""
    w = trim_width(np.asarray(tb.attention_mask), buckets)
    return tb.replace(**{f: getattr(tb, f)[:, -w:] for f in
                         ("tokens", "attention_mask", "loss_mask", "old_logp", "ref_logp", "advantage")})


def logprob_window(config) -> int:
    """Columns at the end of a token row that can hold a trained response: the longest budget of
    a trained call kind (strategies, revisions and actions; judgments with algo.judge_train). The update and the
    scoring run the vocabulary head on these columns only (see train.sequence_logprobs)."""
    s = config.sampling
    return int(max(s.max_action_tokens, s.max_strategy_tokens, s.max_judge_tokens if config.algo.judge_train else 0))


def check_window(loss_mask: np.ndarray, window: int) -> None:
    """A loss token before the window would silently get log-prob 0: refuse instead."""
    if loss_mask.shape[1] > window and loss_mask[:, :-window].any():
        raise ValueError(f"a trained response is longer than the log-prob window ({window} tokens = the "
                         "largest sampling budget); rows must end with their response")


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _score_window(graphdef, chunk: int, window: int, params, tokens, mask):
    """Teacher-forced log-probs [S, L] on the last `window` columns: the update's own forward."""
    return sequence_logprobs(graphdef, params, tokens, mask, chunk, False, window)[0]


def _score_rows(run: Run, params, tokens: np.ndarray, mask: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """Teacher-forced log-probs [S, L] (0 off the loss) of the rows that have loss tokens.

    Rows are scored in length order, mini-batch-sized chunks each cut to its own length bucket:
    attention costs ~ length^2 here, so a chunk of short rows must not pay for the longest row.
    """
    rows = int(run.config.train.mini_batch_rows)
    buckets = run.config.train.length_buckets
    check_window(loss_mask, run.window)
    out = np.zeros(tokens.shape, np.float32)
    live = np.flatnonzero(loss_mask.any(axis=1))
    order = live[np.argsort(mask[live].sum(axis=1), kind="stable")]
    for i in range(0, len(order), rows):
        idx = order[i:i + rows]
        n = len(idx)
        tk, mk = tokens[idx], mask[idx]
        if n < rows:  # pad to one shape per bucket
            tk = np.concatenate([tk, np.full((rows - n, tk.shape[1]), run.pad_id, tk.dtype)])
            mk = np.concatenate([mk, np.zeros((rows - n, mk.shape[1]), bool)])
        w = trim_width(mk, buckets)
        tk, mk = _to_mesh(run, (tk[:, -w:], mk[:, -w:]))
        lp = _score_window(run.graphdef, int(run.config.train.logprob_chunk), run.window, params, tk, mk)
        out[idx, -w:] = sharding.fetch_global(lp)[:n]
    return np.where(loss_mask, out, 0.0).astype(np.float32)


def _to_mesh(run, tree):
    """Several processes: the host rows (the same on every process) as global arrays split over
    the data axes, each process supplying its own devices' rows. One process: unchanged (host
    numpy goes to the jitted function as before)."""
    if getattr(run, "nproc", 1) == 1:
        return tree
    return sharding.global_from_host(tree, sharding.data_sharding(run.mesh))


def rollout_config(config, eval_mode: bool = False) -> RolloutConfig:
    """The run's rollout settings. The per-step bar only with log.rollout_progress: it redraws on
    every policy call and floods captured logs, while the iteration bar keeps the rate and ETA."""
    cfg = RolloutConfig.from_config(config, eval_mode=eval_mode)
    return dataclasses.replace(cfg, progress=bool(config.log.progress and config.log.rollout_progress))


def _bucket_of(h: np.ndarray) -> np.ndarray:
    return np.where(h <= 4, 0, np.where(h <= 7, 1, 2))


# --------------------------------------------------------------------------------------------
# one iteration


def collect_iteration(run: Run, envs, iteration: int, n_train: int | None):
    """This iteration's rollouts over all P tasks, the same on every process.

    Each process collects its own shards (one after the other, each with its own sampling keys;
    see rollout/shards.py), then the shards are gathered to every process and merged. One shard
    (the default on one process) is exactly the plain `collect` over all tasks.
    """
    config = run.config
    cfg = rollout_config(config)
    if run.nproc > 1:
        cfg = dataclasses.replace(cfg, progress=cfg.progress and run.lead)
    per_shard = shard_tasks(train_tasks(config, iteration, n_train), run.shards)
    mine = []
    for shard in run.my_shards:
        run.policy.reseed(int(config.seed), iteration, shard=None if run.shards == 1 else shard)
        mine.append(collect(envs, run.policy, per_shard[shard], cfg))
    if run.nproc > 1:
        mine = [r for part in sharding.allgather_objects([to_host(r) for r in mine]) for r in part]
    return merge_results(mine, cfg)


def iteration_step(run: Run, envs, iteration: int, n_train: int | None) -> tuple[dict, Any]:
    config = run.config
    times = {}
    t0 = time.perf_counter()
    run.sync_policy()
    run.set_temperature(config.sampling.temperature, config.sampling.strategy_temperature)
    tok0, s0 = run.policy.tokens_generated, run.policy.sample_seconds
    kind0 = dict(run.policy.seconds_by_kind)
    res = collect_iteration(run, envs, iteration, n_train)
    times["rollout"] = time.perf_counter() - t0
    kind_s = {k: run.policy.seconds_by_kind[k] - kind0.get(k, 0.0) for k in run.policy.seconds_by_kind}

    t1 = time.perf_counter()
    tb = res.tokens
    tokens_np, mask_np = np.asarray(tb.tokens), np.asarray(tb.attention_mask)
    loss_mask = np.asarray(tb.loss_mask)
    ref = _score_rows(run, run.ref_params, tokens_np, mask_np, loss_mask)
    old = (_score_rows(run, run.state.params, tokens_np, mask_np, loss_mask) if config.train.recompute_old_logp
           else np.where(loss_mask, np.asarray(tb.old_logp), 0.0).astype(np.float32))
    tb = tb.replace(ref_logp=ref, old_logp=old)
    times["score"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    adv = _compute_advantages(res.traj, run.adv_params, algo=config.algo.name)
    tb = token_advantages(res.traj, adv, tb, run.adv_params, str(config.train.step_weighting))
    diag = jax.device_get(compute_diagnostics(res.traj, adv))
    times["advantages"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    rows = int(config.train.mini_batch_rows)
    sums: dict[str, float] = {}
    n_steps = no_signal = 0
    for mb in minibatches(jax.tree.map(np.asarray, tb), rows, seed=int(config.seed) * 100003 + iteration):
        if config.train.skip_no_signal and not has_signal(mb):
            no_signal += 1
            continue
        mb = trim_rows(mb, config.train.length_buckets)
        check_window(np.asarray(mb.loss_mask), run.window)
        # Every process cut the same mini-batches from the same gathered batch (same seed).
        run.state, m = run.train_step(run.state, _to_mesh(run, mb), float(config.algo.lam_strategy))
        m = jax.device_get(m)
        n_steps += 1
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(np.asarray(v))
    times["update"] = time.perf_counter() - t3
    # Gather the new params for the samplers now, on every process together, so that process 0
    # can evaluate alone after this step without waiting in a collective (docs/TPU.md).
    run.sync_policy()

    row = {"iteration": iteration}
    row.update(_diag_row("train", diag))
    row["train/success"] = float(res.stats["success_rate"])
    row.update(judge_quality_row(res.traj) if config.algo.judgment else {})  # issue #15: judge/precision, judge/recall
    row["train/episode_return"] = float(np.asarray(res.traj.episode_return)[np.asarray(res.traj.traj_mask)].mean()) \
        if np.asarray(res.traj.traj_mask).any() else 0.0
    for k in ("invalid_rate", "crashed", "unrun", "judge_parse_fail_rate", "judged_bad_steps", "strategy_malformed",
              "milestones", "mean_episode_len", "revisions", "revision_malformed"):
        if k in res.stats:
            row[f"train/{k}"] = float(res.stats[k])
    for k in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "grad_norm"):
        if k in sums:
            row[f"update/{k}"] = sums[k] / max(n_steps, 1)
    row["update/skipped_total"] = float(np.asarray(run.state.skipped))
    row["update/steps"] = n_steps
    row["update/no_signal_skipped"] = no_signal
    gen_tok = run.policy.tokens_generated - tok0
    row["time/sample_tok_s"] = gen_tok / max(run.policy.sample_seconds - s0, 1e-9)
    row["time/train_tok_s"] = float(np.asarray(tb.attention_mask).sum()) / max(times["update"], 1e-9)
    for k, v in times.items():
        row[f"time/{k}_s"] = v
    # The rollout's policy time by call kind: StraTA's strategy and self-judgment calls vs the
    # action calls every algorithm makes (bench/iteration.py reads these).
    row["time/judge_s"] = kind_s.get("judge", 0.0)
    row["time/strategy_s"] = kind_s.get("strategy", 0.0)
    row["time/action_s"] = kind_s.get("action", 0.0)
    row["time/iteration_s"] = time.perf_counter() - t0
    return row, res


def _diag_row(prefix: str, diag: dict) -> dict:
    out = {}
    for k, v in diag.items():
        a = np.asarray(v)
        if a.ndim == 0:
            out[f"{prefix}/{k}"] = float(a)
    return out


# --------------------------------------------------------------------------------------------
# evaluation


def evaluate(run: Run, envs, tasks: list[int], temperature: float, prefix: str, task_types: dict) -> dict:
    """Success overall, per horizon bucket and per task type on held-out tasks (one episode each).

    Several processes: only process 0 evaluates (no collective inside), with the params
    iteration_step already gathered."""
    if run.nproc > 1 and run._synced is not run.state:
        raise RuntimeError("evaluate on several processes needs a policy synced by every process first "
                           "(Run.sync_policy): gathering the params here would wait forever on the others")
    run.sync_policy()
    run.policy.reseed(int(run.config.seed) + 1, 0)  # the same eval samples for every checkpoint
    run.set_temperature(temperature)
    cfg = dataclasses.replace(rollout_config(run.config, eval_mode=True), progress=False)
    res = collect(envs, run.policy, tasks, cfg)
    won = np.asarray(res.traj.won)[:, 0, 0]
    valid = np.asarray(res.traj.traj_mask)[:, 0, 0]
    horizon = np.asarray(res.traj.horizon)
    out = {f"{prefix}/success": float(won[valid].mean()) if valid.any() else 0.0,
           f"{prefix}/tasks": int(valid.sum())}
    bk = _bucket_of(horizon)
    for i, name in enumerate(BUCKETS):
        sel = valid & (bk == i)
        if sel.any():
            out[f"{prefix}/success_{name}"] = float(won[sel].mean())
            out[f"{prefix}/n_{name}"] = int(sel.sum())
    types = np.asarray([task_types.get(t, "unknown") for t in tasks])
    for ty in sorted(set(types)):
        sel = valid & (types == ty)
        if sel.any():
            out[f"{prefix}/success_type/{ty}"] = float(won[sel].mean())
    return out


def task_types_of(config, tasks: list[int], split: str) -> dict:
    """task seed -> task type (reset each task once; cheap for household, a few ms per ALFWorld game)."""
    from rollout.envs import make_env

    env = make_env(config.env.name, **env_kwargs(config, split))
    out = {}
    for t in tasks:
        _, info = env.reset(seed=t)
        out[t] = str(info.get("task_type", "unknown"))
    if hasattr(env, "close"):
        env.close()
    return out


def timed_evals(run: Run, envs, tasks, types) -> dict:
    t0 = time.perf_counter()
    out = run_evals(run, envs, tasks, types)
    out["time/eval_s"] = time.perf_counter() - t0
    return out


def run_evals(run: Run, envs, tasks, types) -> dict:
    c = run.config
    out = evaluate(run, envs, tasks, float(c.sampling.eval_temperature), "eval", types)
    if c.eval.greedy:
        out.update(evaluate(run, envs, tasks, 0.0, "eval_greedy", types))
    return out


# --------------------------------------------------------------------------------------------
# entry points (launch.py modes)


def _save_batch(workdir: pathlib.Path, iteration: int, traj: TrajectoryBatch, texts: dict | None = None) -> None:
    """The iteration's TrajectoryBatch (what `ablate` reads) and, beside it, its texts (strategies,
    actions, judgments) so a person can read what the numbers were computed from."""
    d = workdir / "batches"
    d.mkdir(exist_ok=True)
    np.savez_compressed(d / f"iter_{iteration:05d}.npz",
                        **{f.name: np.asarray(getattr(traj, f.name)) for f in dataclasses.fields(traj)})
    if texts is not None:
        (d / f"iter_{iteration:05d}.texts.json").write_text(json.dumps(texts, indent=1, default=str))


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


def train(config, workdir) -> dict:
    workdir = pathlib.Path(workdir)
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
    eval_envs = make_envs(c, min(int(c.eval.num_tasks), n_eval or int(c.eval.num_tasks)), c.env.eval_split) \
        if evaluating else None
    etasks = eval_tasks(c, n_eval)
    types = task_types_of(c, etasks, c.env.eval_split) if evaluating else {}
    title = f"{c.algo.name} on {c.env.name} ({workdir.name})"
    if not run.lead:
        c = _quiet(c)
    if run.start_iteration == 1 and evaluating:
        if c.log.progress:
            tqdm.write(f"evaluating the starting model on {len(etasks)} held-out tasks")
        row = {"iteration": 0}
        row.update(timed_evals(run, eval_envs, etasks, types))
        log.append(row)
        if c.log.progress:
            tqdm.write(f"iteration 0: eval/success {row['eval/success']:.3f}"
                       + (f", eval_greedy/success {row['eval_greedy/success']:.3f}" if c.eval.greedy else "")
                       + f" ({row['time/eval_s']:.0f} s)")
    last = {}
    bar = tqdm(range(run.start_iteration, int(c.iterations) + 1), desc=f"{c.algo.name}", initial=run.start_iteration - 1,
               total=int(c.iterations), disable=not c.log.progress, dynamic_ncols=True)
    for it in bar:
        row, res = iteration_step(run, envs, it, n_train)
        if evaluating and (it % int(c.eval.every) == 0 or it == int(c.iterations)):
            bar.set_postfix_str(f"iteration {it}: evaluating on {len(etasks)} held-out tasks", refresh=True)
            row.update(timed_evals(run, eval_envs, etasks, types))
        if c.log.save_batches and run.lead:
            _save_batch(workdir, it, res.traj, res.texts)
        log.append(row)
        # every process saves: orbax writes each process's own shards of the state
        if c.checkpoint.every and (it % int(c.checkpoint.every) == 0 or it == int(c.iterations)):
            run.ckpt.save(it, run.state, extra={"iteration": it}, force=True)
        if c.log.plots_every and it % int(c.log.plots_every) == 0 and run.lead:
            _plots(workdir, log.history, title)
        bar.set_postfix(success=f"{row['train/success']:.2f}", ret=f"{row['train/episode_return']:.2f}",
                        tok_s=f"{row['time/sample_tok_s']:.0f}",
                        eval=f"{row.get('eval/success', float('nan')):.2f}")
        last = row
    run.ckpt.wait()
    if run.lead:
        _plots(workdir, log.history, title)
    log.close()
    for pool in (envs, eval_envs):
        if hasattr(pool, "close"):
            pool.close()
    return last


def _quiet(config):
    """The config with progress output off (processes other than 0 print no bars)."""
    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.log.progress = False
    return config


def sft_only(config, workdir) -> None:
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if config.model.path:
        raise ValueError("launch.py sft builds and warm-starts the tiny model; with config.model.path set, "
                         "give demonstrations via config.sft.demos and train from that path")
    path = model_dir(config, workdir, make_mesh(config))
    print(f"SFT model: {path}")


def evaluate_run(config, workdir) -> dict:
    workdir = pathlib.Path(workdir)
    run = Run(config, workdir, for_training=False)
    if not run.lead:  # several processes: process 0 evaluates alone (evaluate needs no collective)
        return {}
    n_eval = num_tasks(config, config.env.eval_split)
    tasks = eval_tasks(config, n_eval)
    envs = make_envs(config, len(tasks), config.env.eval_split)
    types = task_types_of(config, tasks, config.env.eval_split)
    out = {"iteration": run.start_iteration - 1}
    out.update(run_evals(run, envs, tasks, types))
    (workdir / "eval.json").write_text(json.dumps(out, indent=2))
    width = max(len(k) for k in out)
    for k, v in out.items():
        print(f"{k:<{width}}  {v:.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    return out


def export(config, workdir, out_dir) -> pathlib.Path:
    """The latest checkpoint's params in Hugging Face format (transformers loads it)."""
    workdir = pathlib.Path(workdir)
    run = Run(config, workdir, for_training=False)
    if run.nproc > 1:
        raise ValueError("export runs on one process: drop --config.mesh.distributed (the checkpoint "
                         "restores on any mesh)")
    out = pathlib.Path(out_dir)
    export_hf(run.state.params, run.mcfg, run.tokenizer, out)
    print(f"exported iteration {run.start_iteration - 1} to {out}")
    return out


def ablate(config, workdir, grid: list[str]) -> pathlib.Path:
    from rollout.ablate import run_ablation

    return run_ablation(config, pathlib.Path(workdir), grid)
