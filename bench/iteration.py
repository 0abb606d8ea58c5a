"""Time per training iteration on the household world, StraTA vs GRPO at equal trajectories.

Both runs use the household config (configs/tiny_household.py) from the same SFT'd tiny model,
which is built once in a temporary workdir with a short SFT (`--sft-steps`). StraTA runs
P x N x M = 4 x 2 x 4 trajectories per iteration, GRPO P x G = 4 x 8 (no strategies, no
self-judgment), everything else equal. Phases are taken from the trainer's own metrics row
(`time/*` of rollout/iteration.iteration_step):

    strategies   the StraTA strategy call (sigma*N candidates per task + selection)   time/strategy_s
    actions      the rest of the rollout: action calls, env steps, prompts, batches    time/rollout_s - strategy - judge
    judgment     the self-judgment call                                               time/judge_s
    scoring      reference (and, if configured, old) log-probs                        time/score_s
    advantages   advantages + diagnostics (jitted)                                    time/advantages_s
    update       the optimiser steps over the iteration's rows                        time/update_s

Compilation is kept out of the figures: each measured iteration is first run once from the same
train state (compiling whatever its shapes need), then the state is restored and the iteration
is run again and timed, `--repeats` times, alternating between StraTA and GRPO; each figure is
the minimum over the repeats (a load that comes and goes then hits neither side's figure). An
iteration is a pure function of (seed, iteration, state), so the timed runs repeat the warm-up
exactly. Figures are means over `--iterations` such iterations (each a different task set). The
two algorithms take different actions, so their episodes differ in length; the per-env-step time is printed too.

    python bench/iteration.py [--iterations 2] [--repeats 2] [--sft-steps 30] [--keep DIR] [--set KEY=VALUE ...]
                              [--config configs/tiny_alfworld.py] [--model qwen2.5-7b] [--devices 8]
                              [--plan-as-run] [--think-tokens R] [--tasks-times K ...]

`--config` swaps the household config for another StraTA config (the same GRPO twin is derived
from it): configs/tiny_alfworld.py runs real ALFWorld games (unpack them first, see that file),
the regime of the StraTA paper's +2.3% (ALFWorld prompts, long episodes).

`--set sampling.shared_prefix=False` (any config key, repeatable) changes both runs alike;
`--set sampling.prefix_cache=True` runs both with the cross-call prefix cache. The rollout's
sampler time is split into its prefills and its decodes (every call kind), the rest of the rollout
(environment steps, prompts, batches) printed as `other`. `--model-dir DIR` starts both runs from a
warm-started model (a run's sft_model/, e.g. SmolLM2's with `--config configs/smol_household.py`)
instead of the tiny model's SFT. `--eval-tasks K` also times an evaluation of K held-out tasks
per algorithm and prints its share of an iteration at the config's eval.num_tasks and eval.every.
Prints one line per figure: each phase for each algorithm, the totals, the padded prefill tokens
the sampler ran per iteration, the batch's tokens and the padded tokens the update ran
(`train.shared_prefix` shares prompt prefixes there), and StraTA's overhead over GRPO in percent (per iteration and per
env step).

Then the same iterations modelled at a real model's size (`--model`, default qwen2.5-7b) on
`--devices` H200s: every prefill, decode step, scoring pass and update step of the timed runs was
counted from its padded shapes (strata_jax/cost.py), and a roofline turns those counts into seconds
per phase (40% MFU, 60% of the HBM bandwidth: the stated goals). These figures do not move with the
host's load, and they weigh the work as a 7B model would (matmul-bound, where the tiny model is
attention-bound); they are a model, not a measurement. The counts are those of the tiny model's
tokenizer and behaviour (its strategies, actions and episode lengths). A last line models the
same passes on their rows' real tokens alone (no padding, no shared prefixes), the cost model of
a padding-free update such as verl's. A `tokens` line per algorithm sets the update's and one
scoring pass's token slots against a perfect prefix tree's (strata_jax/packing.prefix_tree_tokens:
every distinct prompt prefix once, no padding), the lower bound of any prefix-sharing layout.

The scoring and the update pack their rows as a run of the modelled model would (`run.plan_model`:
its attention pairs weigh little against its tokens, so wider packed rows and prefix trees pay);
`--plan-as-run` packs them for the tiny model instead.

`--think-tokens R` counts the work of a policy that reasons for R more tokens before it acts (as
the step prompt asks, "First reason ... inside <think>...</think>"; a Qwen-class model writes
sentences there, the tiny model a fixed 6 words). Every action response gets R filler tokens at its
start before the scoring (`with_thoughts`), so the scoring and the update plan, pack and run the
longer rows (their log-prob window R columns wider); every action decode is counted R steps
longer, over a cache R slots larger. The prompts are unchanged: the history shows a step's
action, not its reasoning. The rollout itself (actions, episodes) is the tiny model's, the same
as without the option; the counts are those of the same episodes written by a policy that reasons.

`--tasks-times K` (repeatable) also models an iteration of K times the tasks: every call's rows,
tokens and pairs times K (strata_jax/cost.Work.times). The token passes grow with the tasks, but a
decode step of a few rows per device takes the time of reading the weights whatever its rows, so
a small P overstates the decode's share. With `--keep DIR` the counted work is also written to
DIR/iteration.json, which `--from DIR/iteration.json` models again (say at another `--model`,
`--devices` or `--tasks-times`) without running anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from rollout.cpu_memory import keep_freed_memory_on_cpu  # noqa: E402

keep_freed_memory_on_cpu()  # as launch.py does, before jax starts its threads

from strata_jax.cost import MODELS  # noqa: E402

PHASES = ("strategies", "actions", "judgment", "scoring", "advantages", "update")


def configs(sft_steps: int, overrides: list[str] = (), config_file: str = "configs/tiny_household.py"):
    """(StraTA config, GRPO config, (eval.num_tasks, eval.every) as the file sets them) from a StraTA
    config file (default: the household config); same model, same everything else. The runs
    evaluate nothing themselves (`--eval-tasks` times an evaluation apart)."""
    import copy

    from configs.base import apply_overrides, load_config_file, validate

    strata = load_config_file(config_file)
    if strata.algo.name != "strata":
        raise SystemExit(f"--config {config_file}: algo.name is {strata.algo.name!r}, expected 'strata'")
    apply_overrides(strata, overrides)
    strata.sft.steps = sft_steps
    strata.log.progress = False
    file_eval = (int(strata.eval.num_tasks), int(strata.eval.every))
    strata.eval.every = 0
    strata.checkpoint.every = 0
    strata.log.save_batches = False
    grpo = copy.deepcopy(strata)  # same sizes, budgets, model and training settings
    grpo.algo.name = "grpo"
    grpo.algo.group_size = strata.algo.num_strategies * strata.algo.traj_per_strategy
    grpo.algo.judgment = False
    grpo.algo.diverse = False
    return validate(strata), validate(grpo), file_eval


def with_thoughts(tb, think: int, horizon: int, vocab: int, seed: int):
    """TokenBatch `tb` [S, L] -> [S, L + think]: every action-step row (0 <= t < horizon, with loss
    tokens) gets `think` random tokens in [1, vocab) at the start of its response, trained like
    the rest of it (loss mask on, old log-prob 0: the scoring recomputes it); every other row is
    left-padded by `think` columns. Rows stay left-padded with the response at their end."""
    import jax
    import numpy as np

    from strata_jax.packing import TOKEN_FIELDS

    tb = jax.tree.map(np.asarray, tb)
    s, _ = tb.tokens.shape
    t = tb.row_index[:, 3]
    start = np.where(tb.loss_mask.any(axis=1), tb.loss_mask.argmax(axis=1), -1)  # response start column
    act = tb.row_valid & (t >= 0) & (t < horizon) & (start >= 0)
    filler = np.random.default_rng(seed).integers(1, vocab, size=(s, think))
    out = {}
    for f in TOKEN_FIELDS:
        x = getattr(tb, f)
        if x is None:
            continue
        fill = {"attention_mask": True, "loss_mask": True}.get(f, 0)
        rows = []
        for r in range(s):
            if act[r]:
                ins = filler[r].astype(x.dtype) if f == "tokens" else np.full(think, fill, x.dtype)
                rows.append(np.concatenate([x[r, : start[r]], ins, x[r, start[r] :]]))
            else:
                rows.append(np.concatenate([np.zeros(think, x.dtype), x[r]]))
        out[f] = np.stack(rows)
    return tb.replace(**out)


class Thoughts:
    """`--think-tokens`: the action rows widened by `with_thoughts` before the scoring (a patch of
    rollout.iteration.score_batch, so that the update runs them too), and every action decode
    counted `think` steps longer. `last` holds the latest widened batch (for `tree_bound`)."""

    def __init__(self, think: int):
        import rollout.iteration as iteration
        import rollout.run

        self.think, self.last = think, None
        original = iteration.score_batch
        window = rollout.run.logprob_window  # the Run's scoring and update window: R columns wider
        rollout.run.logprob_window = lambda config: window(config) + think

        def score_batch(run, tokens, params):
            self.last = with_thoughts(
                tokens, think, int(run.config.env.max_steps), int(run.mcfg.vocab_size), seed=int(run.config.seed)
            )
            return original(run, self.last, params)

        iteration.score_batch = score_batch

    def count_decodes(self, sampler) -> None:
        work, think = sampler.work, self.think
        add = work.add_decode
        work.add_decode = lambda rows, steps, cache: add(rows, steps + think, cache + think) if steps > 0 else None


def tree_bound(tb, rows: int, seed: int) -> dict[str, float]:
    """Tokens a perfect prefix tree would run (strata_jax/packing.prefix_tree_tokens): over the
    update's mini-batches (the iteration's own split) and over one scoring pass's chunks (the rows
    with loss tokens in token order, as rollout/scoring.score_rows cuts them)."""
    import jax
    import numpy as np

    from strata_jax.batch import token_order
    from strata_jax.packing import prefix_tree_tokens
    from strata_jax.train import minibatches

    tb = jax.tree.map(np.asarray, tb)
    update = sum(prefix_tree_tokens(mb) for mb in minibatches(tb, rows, seed=seed))
    order = token_order(tb.tokens, tb.attention_mask, np.flatnonzero(tb.loss_mask.any(axis=1)))
    score = sum(
        prefix_tree_tokens(jax.tree.map(lambda x, i=order[i : i + rows]: x[i], tb)) for i in range(0, len(order), rows)
    )
    return {"tree_update": float(update), "tree_score": float(score)}


def phase_work(by_source: dict) -> dict:
    """The iteration's model work (strata_jax/cost.Work) per phase, from the samplers' (by call
    kind) and the run's (score, update) counters."""
    from strata_jax.cost import Work

    work = {
        "strategies": by_source.pop("strategy", Work()),
        "judgment": by_source.pop("judge", Work()),
        "scoring": by_source.pop("score"),
        "update": by_source.pop("update"),
    }
    work["actions"] = sum(by_source.values(), Work())  # the action calls (and any other kind)
    return work


def modelled(work: dict, model: str, devices: int, real: bool = False) -> dict[str, float]:
    """Seconds per phase of one iteration's counted work at `model`'s size on `devices` H200s
    (strata_jax/cost.py's roofline at its stated efficiencies); `real`: the passes on their real
    tokens only."""
    from strata_jax import cost

    hw = dataclasses.replace(cost.H200, devices=devices, name=f"{devices} x H200")
    m = cost.MODELS[model]
    return {k: cost.seconds(w, m, hw, train=k == "update", real=real) for k, w in work.items()}


def phases(row: dict) -> dict[str, float]:
    strategies, judgment = row["time/strategy_s"], row["time/judge_s"]
    return {
        "strategies": strategies,
        "actions": row["time/rollout_s"] - strategies - judgment,
        "judgment": judgment,
        "scoring": row["time/score_s"],
        "advantages": row["time/advantages_s"],
        "update": row["time/update_s"],
    }


class Measured:
    """One algorithm's run: its train state, environments and samplers, timed one iteration at a
    time from a saved start state (so that repeats and the warm-up run the same iteration)."""

    def __init__(self, config, workdir: pathlib.Path, plan_model=None, thoughts: Thoughts | None = None):
        from rollout.run import Run
        from rollout.setup import make_envs, trajectories_per_task

        self.run = Run(config, workdir)
        if plan_model is not None:  # pack the scoring and the update as a run of that model would
            self.run.plan_model = plan_model
        per_iter = config.algo.tasks_per_iter * trajectories_per_task(config)
        self.envs = make_envs(config, per_iter, config.env.split)
        self.samplers = self.run.policy.samplers  # by call kind
        self.thoughts = thoughts
        if thoughts is not None:
            thoughts.count_decodes(self.samplers["action"])

    def _work(self) -> dict:
        return {
            **{k: s.work.snapshot() for k, s in self.samplers.items()},
            **{k: w.snapshot() for k, w in self.run.work.items()},
        }

    def once(self, it: int, keep: bool) -> dict[str, float]:
        """Run iteration `it` from the current state; restore that state unless `keep`. Returns
        its phase seconds, padded prefill tokens, update figures and env steps."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from rollout.iteration import iteration_step

        start = jax.tree.map(jnp.copy, self.run.state)  # the update donates the state: keep a copy
        before = sum(x.prefill_tokens for x in self.samplers.values())
        seconds0 = {part: sum(x.seconds[part] for x in self.samplers.values()) for part in ("prefill", "decode")}
        work0 = self._work()
        row, res = iteration_step(self.run, self.envs, it, None)
        out = dict(phases(row))
        for part in ("prefill", "decode"):  # the samplers' share of the rollout (every call kind)
            out[f"rollout_{part}"] = sum(x.seconds[part] for x in self.samplers.values()) - seconds0[part]
        out["work"] = phase_work({k: w.since(work0[k]) for k, w in self._work().items()})
        out["prefill_tokens"] = float(sum(x.prefill_tokens for x in self.samplers.values()) - before)
        # what the update ran: mini-batches trained, those skipped for carrying no signal
        # (train.skip_no_signal), and the tokens of the iteration's batch
        out["update_steps"] = float(row.get("update/steps", 0.0))
        out["no_signal"] = float(row.get("update/no_signal_skipped", 0.0))
        out["train_tokens"] = float(row.get("time/train_tok_s", 0.0)) * row["time/update_s"]
        # padded tokens the update's forward ran (fewer than the batch's with train.shared_prefix)
        out["update_tokens"] = float(row.get("time/update_model_tokens", 0.0))
        out["env_steps"] = float(np.asarray(res.traj.step_mask).sum())
        tokens = res.tokens
        if self.thoughts is not None:  # the widened rows the scoring and the update ran
            if res.traj.step_mask.shape[-1] != int(self.run.config.env.max_steps):
                raise RuntimeError("--think-tokens: the batch's horizon is not env.max_steps; action rows unknown")
            tokens = self.thoughts.last
        out.update(
            tree_bound(tokens, int(self.run.config.train.mini_batch_rows), int(self.run.config.seed) * 100003 + it)
        )
        if not keep:
            self.run.state = start
        return out

    def evaluation(self, n: int) -> float:
        """Seconds of an evaluation of n held-out tasks (compiled first by an untimed one)."""
        import time

        from rollout.evaluate import evaluation_rollout
        from rollout.setup import eval_tasks, make_envs, num_tasks

        c = self.run.config
        c.eval.num_tasks = n
        tasks = eval_tasks(c, num_tasks(c, c.env.eval_split))
        envs = make_envs(c, len(tasks), c.env.eval_split)
        temperature = float(c.sampling.eval_temperature)
        evaluation_rollout(self.run, envs, tasks, temperature)
        t0 = time.perf_counter()
        evaluation_rollout(self.run, envs, tasks, temperature)
        dt = time.perf_counter() - t0
        self.run.set_temperature(float(c.sampling.temperature), float(c.sampling.strategy_temperature))
        if hasattr(envs, "close"):
            envs.close()
        return dt

    def close(self) -> None:
        if hasattr(self.envs, "close"):
            self.envs.close()


def measure(benches: dict[str, Measured], iterations: int, repeats: int) -> dict[str, dict[str, float]]:
    """Per algorithm: mean over `iterations` of each figure's minimum over `repeats` timed runs,
    and under "work" the counted model work per phase, summed over the iterations.

    Every iteration is first run once per algorithm (compiling its shapes) and the state restored;
    then the timed runs alternate between the algorithms (strata, grpo, strata, grpo, ...), so
    that a load that comes and goes on a shared machine hits both alike, and the minimum drops
    the runs it hit. The runs of one iteration are identical (a pure function of seed, iteration
    and state), so they differ in time only. `repeats` = 0 counts only: each iteration runs once
    per algorithm, with no warm-up, and its times (compilation included) are not comparable.
    """
    from strata_jax.cost import Work

    sums = {name: {"work": {}} for name in benches}
    for it in range(1, iterations + 1):
        if repeats:
            for b in benches.values():
                b.once(it, keep=False)  # warm-up
        best: dict[str, dict[str, float]] = {name: {} for name in benches}
        works: dict[str, dict] = {}
        for r in range(max(repeats, 1)):
            for name, b in benches.items():
                fig = b.once(it, keep=r == max(repeats, 1) - 1)
                works[name] = fig.pop("work")  # counted: the same in every repeat
                for k, v in fig.items():
                    best[name][k] = min(best[name].get(k, float("inf")), v)
        for name in benches:
            for k, v in best[name].items():
                sums[name][k] = sums[name].get(k, 0.0) + v / iterations
            total = sums[name]["work"]
            for k, w in works[name].items():
                total[k] = total.get(k, Work()) + w
    for s in sums.values():
        s["total"] = sum(s[k] for k in PHASES)
    return sums


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=2, help="measured iterations per algorithm")
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed runs per iteration and algorithm, alternating; the minimum is kept "
        "(0: count the work only, one untimed run each)",
    )
    ap.add_argument("--sft-steps", type=int, default=30, help="SFT steps of the shared tiny model")
    ap.add_argument("--keep", default=None, help="workdir to keep (default: a temporary one)")
    ap.add_argument(
        "--model-dir",
        default=None,
        metavar="DIR",
        help="start both runs from this warm-started HF model (default: SFT the config's model)",
    )
    ap.add_argument(
        "--eval-tasks",
        type=int,
        default=0,
        metavar="K",
        help="also time an evaluation of K held-out tasks per algorithm",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for both runs, e.g. sampling.shared_prefix=False",
    )
    ap.add_argument(
        "--config",
        default="configs/tiny_household.py",
        help="the StraTA config both runs derive from (GRPO: the same, flat)",
    )
    ap.add_argument(
        "--model",
        default="qwen2.5-7b",
        choices=sorted(MODELS),
        help="the model size at which the counted work is also modelled (strata_jax/cost.py)",
    )
    ap.add_argument("--devices", type=int, default=8, help="H200s of the modelled node")
    ap.add_argument(
        "--plan-as-run",
        action="store_true",
        help="plan the scoring's and the update's packing for the tiny model that runs (default: "
        "for --model, whose attention weighs far less against its matmuls)",
    )
    ap.add_argument(
        "--tasks-times",
        type=int,
        action="append",
        default=[],
        metavar="K",
        help="also model an iteration of K times the tasks (strata_jax/cost.Work.times: every "
        "call's rows times K); repeatable",
    )
    ap.add_argument(
        "--think-tokens",
        type=int,
        default=0,
        metavar="R",
        help="count every action response R tokens longer: a policy that reasons before it acts (module docstring)",
    )
    ap.add_argument(
        "--from",
        dest="saved",
        default=None,
        metavar="DIR/iteration.json",
        help="model a saved run's counts again (with this --model, --devices, --tasks-times) instead of running",
    )
    a = ap.parse_args()
    if a.saved:
        saved = json.loads(pathlib.Path(a.saved).read_text())
        out, passes = from_json(saved["out"]), saved["passes"]
        a.iterations, a.repeats = saved["iterations"], saved["repeats"]
    else:
        out, passes = run_benches(a)
    report(out, passes, a)


def run_benches(a) -> tuple[dict, dict]:
    """`measure` both algorithms as the flags say -> (its figures, scoring passes per algorithm).
    With `--keep DIR` both are also written to DIR/iteration.json (for `--from`)."""
    from configs.base import start_from
    from rollout.setup import make_mesh
    from rollout.warmstart import model_dir

    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(a.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        strata, grpo, file_eval = configs(a.sft_steps, a.set, a.config)
        model = a.model_dir or model_dir(strata, root / "model", make_mesh(strata))
        thoughts = Thoughts(a.think_tokens) if a.think_tokens > 0 else None
        benches = {}
        for name, cfg in (("strata", strata), ("grpo", grpo)):
            start_from(cfg, model)
            benches[name] = Measured(cfg, root / name, None if a.plan_as_run else MODELS[a.model], thoughts)
        out = measure(benches, a.iterations, a.repeats)
        if a.eval_tasks:
            for name, b in benches.items():
                out[name]["eval_s"] = b.evaluation(a.eval_tasks)
                out[name]["eval_num_tasks"], out[name]["eval_every"] = file_eval
        # scoring passes per iteration: the reference's (unless kl_coef = 0) and the old policy's
        passes = {
            n: int(b.run.reference_params() is not None) + int(bool(b.run.config.train.recompute_old_logp))
            for n, b in benches.items()
        }
        for b in benches.values():
            b.close()
    if a.keep:
        (root / "iteration.json").write_text(
            json.dumps(
                {
                    "out": to_json(out),
                    "passes": passes,
                    "iterations": a.iterations,
                    "repeats": a.repeats,
                    "argv": sys.argv[1:],
                }
            )
        )
    return out, passes


def to_json(out: dict) -> dict:
    return {n: {**r, "work": {p: dataclasses.asdict(w) for p, w in r["work"].items()}} for n, r in out.items()}


def from_json(out: dict) -> dict:
    from strata_jax.cost import Work

    def work(w: dict) -> Work:
        return Work(**{**w, "decode": [tuple(d) for d in w["decode"]]})  # JSON wrote the tuples as lists

    return {n: {**r, "work": {p: work(w) for p, w in r["work"].items()}} for n, r in out.items()}


def report(out: dict, passes: dict, a) -> None:
    """Print the timed figures (when timed) and the modelled ones (module docstring)."""
    s, g = out["strata"], out["grpo"]
    for name, r in out.items():
        if not a.repeats:
            break  # counted only: the times include compilation
        for k in PHASES:
            print(f"iteration {name:6s} {k:10s} {r[k]:8.2f} s")
        print(
            f"iteration {name:6s} {'total':10s} {r['total']:8.2f} s  ({r['env_steps']:.0f} env steps, "
            f"{1000 * r['total'] / max(r['env_steps'], 1):.1f} ms/step)"
        )
        if "rollout_prefill" in r:  # (runs saved before the split was counted have none)
            rollout = r["strategies"] + r["actions"] + r["judgment"]
            other = rollout - r["rollout_prefill"] - r["rollout_decode"]
            print(
                f"iteration {name:6s} {'rollout':10s} {rollout:8.2f} s: prefill {r['rollout_prefill']:.2f} s, "
                f"decode {r['rollout_decode']:.2f} s, other {other:.2f} s (environments, prompts, batches)"
            )
        print(f"iteration {name:6s} {'prefill':10s} {r['prefill_tokens']:8.0f} padded prompt tokens")
        if "eval_s" in r:
            c = (int(r["eval_num_tasks"]), int(r["eval_every"]))
            share = r["eval_s"] * c[0] / a.eval_tasks / max(c[1], 1)
            print(
                f"iteration {name:6s} {'evaluation':10s} {r['eval_s']:8.2f} s for {a.eval_tasks} tasks; "
                f"{share:.2f} s per iteration at {c[0]} tasks every {c[1]} iterations "
                f"({100 * share / (r['total'] + share):.0f} % of an iteration)"
            )
        print(
            f"iteration {name:6s} {'batch':10s} {r['train_tokens']:8.0f} tokens; "
            f"{r['update_steps']:.0f} mini-batches trained, {r['no_signal']:.0f} skipped without signal"
        )
        print(f"iteration {name:6s} {'update':10s} {r['update_tokens']:8.0f} padded tokens through the model")
    if a.repeats:
        print(f"strata overhead over grpo per iteration: {100 * (s['total'] / g['total'] - 1):+.1f} %")
        per_step = (s["total"] / max(s["env_steps"], 1)) / (g["total"] / max(g["env_steps"], 1))
        print(f"strata overhead over grpo per env step:  {100 * (per_step - 1):+.1f} %")
    # The same iterations' counted work at a real model's size: a roofline model, not a timing.
    mod = {name: modelled(r["work"], a.model, a.devices) for name, r in out.items()}
    for name, r in out.items():
        w, m = r["work"], mod[name]
        for k in PHASES:
            if k in w:
                decode = w[k].decode_steps
                print(
                    f"modelled {name:6s} {k:10s} {m[k] / a.iterations:8.3f} s  ({w[k].tokens / a.iterations:10.0f} "
                    f"token slots, {decode / a.iterations:6.0f} decode steps per iteration)"
                )
        print(
            f"modelled {name:6s} {'total':10s} {sum(m.values()) / a.iterations:8.3f} s  "
            f"({r['env_steps']:.0f} env steps)"
        )
    ms, mg = sum(mod["strata"].values()), sum(mod["grpo"].values())
    per_step = (ms / max(s["env_steps"], 1)) / (mg / max(g["env_steps"], 1))
    print(
        f"strata overhead over grpo, modelled at {a.model} on {a.devices} x H200 (40% MFU, 60% of HBM "
        f"bandwidth): {100 * (ms / mg - 1):+.1f} % per iteration, {100 * (per_step - 1):+.1f} % per env step"
    )
    for name, r in out.items():
        print(
            f"tokens {name:6s} update {r['work']['update'].tokens / a.iterations:10.0f} run, "
            f"{r['tree_update']:10.0f} with a perfect prefix tree; one scoring pass "
            f"{r['work']['scoring'].tokens / max(passes[name], 1) / a.iterations:10.0f} run, "
            f"{r['tree_score']:10.0f} with the tree"
        )
    # The same with every pass on its rows' real tokens (no padding, no shared prefixes): the cost
    # model of a padding-free update such as verl's remove-padding.
    rs, rg = (sum(modelled(out[n]["work"], a.model, a.devices, real=True).values()) for n in ("strata", "grpo"))
    print(
        f"strata overhead over grpo, modelled on real tokens only (no padding, no shared prefixes): "
        f"{100 * (rs / rg - 1):+.1f} % ({rs / a.iterations:.3f} s against {rg / a.iterations:.3f} s)"
    )
    # More tasks per iteration: the token passes grow with them, a weight-bound decode step does
    # not (its time is reading the weights), so the decode's share and the overhead move with P.
    for k in a.tasks_times:
        work = {n: {p: w.times(k) for p, w in out[n]["work"].items()} for n in ("strata", "grpo")}
        scaled = {n: modelled(w, a.model, a.devices) for n, w in work.items()}
        ks, kg = (sum(scaled[n].values()) / a.iterations for n in ("strata", "grpo"))
        parts = ", ".join(
            f"{p} {scaled['strata'][p] / a.iterations:.2f} / {scaled['grpo'][p] / a.iterations:.2f}"
            for p in PHASES
            if p in scaled["strata"]
        )
        real = [sum(modelled(work[n], a.model, a.devices, real=True).values()) for n in ("strata", "grpo")]
        print(
            f"strata overhead over grpo, modelled with {k}x the tasks: {100 * (ks / kg - 1):+.1f} % "
            f"({ks:.3f} s against {kg:.3f} s; strata / grpo s: {parts}); on real tokens only "
            f"{100 * (real[0] / real[1] - 1):+.1f} %"
        )


if __name__ == "__main__":
    main()
