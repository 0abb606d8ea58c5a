"""The hierarchical rollout loop: strategies -> batched env steps -> self-judgment -> batches.

One iteration over `P` tasks (ALGORITHMS 0, 3.1-3.4):

1. reset P*N*M environments, trajectory (p, n, m) on env index ((p*N)+n)*M+m, task seed tasks[p];
2. StraTA: one policy call samples sigma*N strategy candidates per task, N are kept by
   farthest-point selection on their embeddings (or the first N); flat mode has no strategy;
3. every step, the prompts of all running envs go to the policy in ONE call; outputs are parsed,
   invalid ones are sent as "" (the env's no-op) and marked invalid;
   with `revise_every = K`, before steps K, 2K, ... one policy call revises the strategy of every
   running trajectory (rollout/revision.py);
4. self-judgment: one policy call over all finished trajectories, `judge_samples` per trajectory
   (rollout/judge.py);
5. TrajectoryBatch [P, N, M, H] + TokenBatch (one row per trained LLM call).

A crashed environment never stops the run: its trajectory keeps its slot with step_mask all False
(masked out of every loss and statistic) and is counted in stats["crashed"].
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout import judge as judge_mod
from rollout import prompts
from rollout import revision as revision_mod
from rollout.envs import INTROS, REWARD_IN_RETURN
from rollout.envs.vector import SerialEnvPool
from rollout.options import CONFIG_KEYS, MODES, first_problem
from rollout.parsing import (
    INADMISSIBLE,
    INVALID_REASONS,
    TOO_LONG,
    action_content_span,
    normalize_action,
    parse_action,
    parse_strategy,
)
from rollout.policy import Generation, Policy
from rollout.progress import progress
from strata_jax import diversity
from strata_jax.batch import TokenBatch, TrajectoryBatch, pad_token_rows, smallest_bucket

# --- configuration --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutConfig:
    mode: str = "strata"  # "strata": N strategies x M trajectories; "flat": N=1, M=group_size
    group_size: int = 8  # G (flat)
    num_strategies: int = 4  # N (strata)
    traj_per_strategy: int = 8  # M (strata)
    oversample: int = 8  # sigma: sigma*N candidates per task
    diverse: bool = True  # farthest-point selection; False = the first N candidates
    judgment: bool = True
    judge_samples: int = 1  # k judgments per trajectory; the strict-majority set is penalised
    judge_train: bool = False  # judgment rows join the TokenBatch (GRPO over the k; needs k >= 2)
    revise_every: int = 0  # K: revise the strategy before steps K, 2K, ... (0 = off; strata only)
    max_steps: int = 30  # H
    history_length: int = 2
    show_first_observation: bool = True  # repeat the first observation in every later step prompt
    action_format: str = "text"  # "index": answer with the number of an admissible command
    r_succ: float = 10.0
    # (choice) where an invalid step's penalty lands: "action" = the tokens of the action's content
    # when the command was wrong (inadmissible, too long), the whole response when the format was
    # (no / several / empty <action> tags); "response" = every response token (the spec's wording).
    # The <think>/<action> format tokens are shared by every step, so "response" pushes the format
    # itself down whenever a command is wrong (from a weak start that reached 98% invalid outputs).
    # "divergence" = only the token at which an inadmissible command stops being the start of any
    # admissible one ("go to cabinet 3" where cabinets 1 and 2 exist: the "3"); the words before
    # it were right, and pushing them down is pushing down every command that starts with them.
    penalty_tokens: str = "action"
    env_reward_in_return: bool = False  # add the env's own shaping to R(tau)
    strategy_budget: int | None = 64  # L_z: z is cut to this many words in step prompts
    judge_excerpt_chars: int = 150
    length_buckets: tuple[int, ...] | None = None  # token-row lengths; None = powers of two
    row_multiple: int = 8  # TokenBatch rows are padded to a multiple of this
    pad_id: int = 0
    intro: str = prompts.INTRO
    progress: bool = True

    @property
    def n(self) -> int:
        return self.num_strategies if self.mode == "strata" else 1

    @property
    def m(self) -> int:
        return self.traj_per_strategy if self.mode == "strata" else self.group_size

    def validate(self) -> RolloutConfig:
        """Raise ValueError naming the field of the first rule broken (rollout/options.py: the
        rules configs/base.py checks on a run config too)."""
        if self.mode not in MODES:
            raise ValueError(f"RolloutConfig.mode={self.mode!r} is not allowed; choose one of {list(MODES)}")
        problem = first_problem(
            {f: getattr(self, f) for f in CONFIG_KEYS},
            strata=self.mode == "strata",
            name=lambda f: f"RolloutConfig.{f}",
            algo=f"mode={self.mode!r}",
        )
        if problem:
            raise ValueError(problem)
        return self

    @property
    def num_revisions(self) -> int:
        """R: revision slots per trajectory."""
        return revision_mod.num_revisions(self.max_steps, self.revise_every)

    @property
    def num_judgments(self) -> int:
        """J: judgments recorded per trajectory (0 without self-judgment)."""
        return self.judge_samples if self.judgment else 0

    @classmethod
    def from_config(cls, c: Any, eval_mode: bool = False) -> RolloutConfig:
        """From the ml_collections run config (configs/base.py).

        `eval_mode`: one trajectory per task (StraTA: one strategy, no oversampling), no judgment.
        """
        strata = c.algo.name.startswith("strata")
        intro = INTROS.get(c.env.name, prompts.INTRO)
        cfg = cls(
            mode="strata" if strata else "flat",
            group_size=c.algo.group_size,
            num_strategies=c.algo.num_strategies,
            traj_per_strategy=c.algo.traj_per_strategy,
            oversample=c.algo.oversample,
            diverse=c.algo.diverse,
            judgment=c.algo.judgment,
            judge_samples=int(c.judge.samples),
            judge_train=bool(c.algo.judge_train),
            revise_every=int(c.algo.revise_every),
            max_steps=c.env.max_steps,
            history_length=c.env.history_length,
            show_first_observation=bool(c.env.show_first_observation),
            action_format=str(c.env.action_format),
            r_succ=c.algo.r_succ,
            strategy_budget=c.algo.strategy_budget,
            penalty_tokens=c.algo.invalid_penalty_tokens,
            env_reward_in_return=c.env.name in REWARD_IN_RETURN,
            length_buckets=tuple(c.train.length_buckets),
            row_multiple=c.train.mini_batch_rows,
            intro=intro,
            progress=c.log.progress,
        )
        if eval_mode:
            cfg = dataclasses.replace(
                cfg,
                group_size=1,
                num_strategies=1,
                traj_per_strategy=1,
                oversample=1,
                diverse=False,
                judgment=False,
                judge_train=False,
            )
        return cfg


@dataclass
class RolloutResult:
    traj: TrajectoryBatch
    tokens: TokenBatch
    stats: dict[str, float]
    texts: dict[str, Any]  # for logging: strategies, candidates, per-trajectory steps, judgments


# --- hashing --------------------------------------------------------------------------------------


def text_id(text: str) -> int:
    """Stable non-negative 63-bit id of a text (blake2b, unlike Python's per-process salted hash)."""
    d = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(d, "little") & 0x7FFF_FFFF_FFFF_FFFF


# --- environments ---------------------------------------------------------------------------------


@dataclass
class EnvOut:
    """One environment's answer to reset (reward etc. unused) or step, or a crash."""

    obs: str = ""
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict = field(default_factory=dict)
    crashed: bool = False
    error: str = ""


def as_pool(envs: Any) -> Any:
    """A list of env instances runs in-process through SerialEnvPool; a pool is used as is."""
    if isinstance(envs, (list, tuple)):
        return SerialEnvPool([functools.partial(_same, env) for env in envs])
    return envs


def _same(env: Any) -> Any:
    return env


def to_env_out(r: Any, is_reset: bool) -> EnvOut:
    """Normalise a pool result (gym tuple or crash record) to EnvOut."""
    if isinstance(r, EnvOut):
        return r
    if getattr(r, "crashed", False):
        return EnvOut(crashed=True, error=str(getattr(r, "error", "")))
    if is_reset:
        obs, info = r
        return EnvOut(obs=str(obs), info=dict(info))
    obs, reward, terminated, truncated, info = r
    return EnvOut(str(obs), float(reward), bool(terminated), bool(truncated), dict(info))


# --- per-iteration state --------------------------------------------------------------------------


class _State:
    """Host-side record of one iteration; step arrays are [E, H] with E = P*N*M, e = (p*N+n)*M+m."""

    def __init__(self, tasks: Sequence[int], cfg: RolloutConfig):
        self.P, self.N, self.M, self.H = len(tasks), cfg.n, cfg.m, cfg.max_steps
        E, H = self.P * self.N * self.M, self.H
        self.E, self.tasks = E, [int(s) for s in tasks]
        z = lambda dt: np.zeros((E, H), dt)  # noqa: E731
        self.step_mask, self.invalid, self.milestone = z(bool), z(bool), z(bool)
        self.judged_bad, self.env_reward = z(bool), z(np.float32)
        self.anchor_id, self.action_id = np.full((E, H), -1, np.int64), np.full((E, H), -1, np.int64)
        self.won, self.crashed = np.zeros(E, bool), np.zeros(E, bool)
        self.alive, self.length = np.zeros(E, bool), np.zeros(E, np.int64)
        self.obs: list[str] = [""] * E
        self.admissible: list[list[str] | None] = [None] * E
        self.history: list[list[tuple[str, str]]] = [[] for _ in range(E)]
        self.gens: list[list[Generation]] = [[] for _ in range(E)]
        self.logs: list[list[dict]] = [[] for _ in range(E)]
        self.invalid_admissible: dict[tuple[int, int], list[str] | None] = {}  # (e, t) of invalid steps
        self.errors: list[str] = [""] * E
        # per task / per strategy
        self.task_line: list[str] = [""] * self.P
        self.first_obs: list[str | None] = [None] * self.P
        self.horizon = np.full(self.P, -1, np.int32)
        self.z: list[list[str | None]] = [[None] * self.N for _ in range(self.P)]
        self.z_gen: list[list[Generation | None]] = [[None] * self.N for _ in range(self.P)]
        self.z_malformed = np.zeros((self.P, self.N), bool)
        self.z_kept = np.zeros((self.P, self.N), bool)
        self.candidates: list[list[str]] = [[] for _ in range(self.P)]
        self.judge_texts: dict[tuple[int, int, int], Any] = {}
        # strategy revision and self-judgment: revisions, the step's strategy slot, state changes, k judgments
        self.rev = revision_mod.Revisions(E, cfg.num_revisions, [None] * E)
        self.step_slot = np.zeros((E, H), np.int32)
        self.changed = np.ones((E, H), bool)
        J = cfg.num_judgments
        self.judge_valid, self.judge_ok = np.zeros((E, J), bool), np.zeros((E, J), bool)
        self.judge_sets = np.zeros((E, J, H), bool)
        self.judge_gens: dict[tuple[int, int], Generation] = {}
        self.policy_s = self.env_s = 0.0
        self.cut_at_horizon = 0
        self.sampled_tokens = 0

    def pnm(self, e: int) -> tuple[int, int, int]:
        p, r = divmod(e, self.N * self.M)
        return (p, *divmod(r, self.M))

    def masked(self) -> np.ndarray:
        """[E] bool: trajectory is out of the batch (crashed, or never ran)."""
        return self.crashed | ~self.step_mask.any(axis=1)


def _generate(policy: Policy, st: _State, prompts_: list, kind: str, keys: list) -> list[Generation]:
    """One timed, checked policy call."""
    t0 = time.perf_counter()
    gens = policy.generate(prompts_, kind, keys=keys)
    st.policy_s += time.perf_counter() - t0
    if len(gens) != len(prompts_):
        raise ValueError(f"policy returned {len(gens)} generations for {len(prompts_)} {kind} prompts")
    for g in gens:
        g.check()
        st.sampled_tokens += len(g.response_ids)
    return gens


def _env_call(st: _State, fn, *args) -> list[EnvOut]:
    t0 = time.perf_counter()
    out = fn(*args)
    st.env_s += time.perf_counter() - t0
    return out


# --- phases ---------------------------------------------------------------------------------------


def _reset(pool: Any, st: _State) -> None:
    seeds = [st.tasks[st.pnm(e)[0]] for e in range(st.E)]
    outs = _env_call(st, pool.reset, list(range(st.E)), seeds)
    for e, r in enumerate(outs):
        r = to_env_out(r, is_reset=True)
        p = st.pnm(e)[0]
        if r.crashed:
            st.crashed[e], st.errors[e] = True, r.error
            continue
        st.alive[e], st.obs[e] = True, r.obs
        st.admissible[e] = r.info.get("admissible_commands")
        if st.first_obs[p] is None:  # every env of a task resets to the same task (seed contract)
            st.first_obs[p], st.task_line[p] = r.obs, str(r.info.get("task", ""))
            st.horizon[p] = int(r.info.get("horizon", -1))


def _strategies(policy: Policy, st: _State, cfg: RolloutConfig) -> None:
    """Sample sigma*N candidates per task in one call; keep N (farthest-point or first N)."""
    K = cfg.oversample * st.N
    live = [p for p in range(st.P) if st.first_obs[p] is not None]
    keys = [(p, k) for p in live for k in range(K)]
    words = prompts.STRATEGY_WORDS if cfg.strategy_budget is None else max(cfg.strategy_budget * 3 // 4, 1)
    msgs = [
        prompts.strategy_prompt(st.task_line[p], st.first_obs[p], max_words=words, intro=cfg.intro) for p, _ in keys
    ]
    gens = _generate(policy, st, msgs, "strategy", keys) if keys else []
    by_key = dict(zip(keys, gens))
    emb, cand, score = _candidate_arrays(st, by_key, K, cfg.diverse)
    idx, kept = select_strategies(emb, cand, score, st.N, cfg.diverse)
    for p in range(st.P):
        st.candidates[p] = [by_key[(p, k)].text for k in range(K) if (p, k) in by_key]
        for n in range(st.N):
            if not kept[p, n]:
                continue
            g = by_key[(p, int(idx[p, n]))]
            st.z[p][n], st.z_malformed[p, n] = parse_strategy(g.text, cfg.strategy_budget)
            st.z_gen[p][n], st.z_kept[p, n] = g, True
    # Trajectories of a strategy slot that has no strategy never run (counted as "unrun").
    slot_kept = np.repeat(st.z_kept.reshape(-1), st.M)
    st.alive &= slot_kept
    st.rev.current = [st.z[p][n] for p, n, _ in map(st.pnm, range(st.E))]


def _candidate_arrays(st: _State, by_key: dict, K: int, diverse: bool):
    """embeddings [P, K, D], candidate mask [P, K], start scores [P, K] (mean token log-prob)."""
    embs = [g.embedding for g in by_key.values()]
    if diverse and any(v is None for v in embs):
        raise ValueError(
            "diverse strategy selection needs Generation.embedding for every strategy; "
            "the policy returned None (set diverse=False or enable embeddings)"
        )
    dim = next((len(v) for v in embs if v is not None), 1)
    emb = np.zeros((st.P, K, dim), np.float32)
    cand = np.zeros((st.P, K), bool)
    score = np.full((st.P, K), -np.inf, np.float32)
    for (p, k), g in by_key.items():
        cand[p, k] = True
        if g.embedding is not None:
            emb[p, k] = g.embedding
        if len(g.logprobs):  # an empty response has no mean; it is never the starting point
            score[p, k] = float(np.mean(g.logprobs))
    return emb, cand, score


def select_strategies(
    emb: np.ndarray, cand: np.ndarray, score: np.ndarray, n: int, diverse: bool
) -> tuple[np.ndarray, np.ndarray]:
    """indices [P, n] into the K candidates and kept [P, n] (ALGORITHMS 3.2)."""
    if diverse:
        idx, kept = diversity.farthest_point_select(emb, cand, score, n)
    else:
        idx, kept = diversity.first_n(cand, n)
    return np.asarray(idx), np.asarray(kept)


def _step_prompt(st: _State, e: int, t: int, cfg: RolloutConfig):
    p, n, _ = st.pnm(e)
    # the strategy in force: z_n, or its latest adopted revision (rollout/revision.py)
    z = st.rev.current[e] if cfg.revise_every else st.z[p][n]
    return prompts.step_prompt(
        st.task_line[p],
        st.obs[e],
        st.admissible[e],
        st.history[e],
        strategy=z,
        step=t,
        history_length=cfg.history_length,
        intro=cfg.intro,
        first_observation=st.first_obs[p] if cfg.show_first_observation else None,
        numbered=cfg.action_format == "index",
    )


def _run_steps(pool: Any, policy: Policy, st: _State, cfg: RolloutConfig, bar) -> None:
    """Up to H steps of every running trajectory; `bar` (rollout/progress.py) counts the steps."""
    bar.status(f"{int(st.alive.sum())} episodes running")
    for t in range(st.H):
        active = np.flatnonzero(st.alive).tolist()
        if not active:
            break
        if revision_mod.is_revision_step(t, cfg.revise_every):
            _revise(policy, st, cfg, active, t)
        msgs = [_step_prompt(st, e, t, cfg) for e in active]
        gens = _generate(policy, st, msgs, "action", [(*st.pnm(e), t) for e in active])
        by_index = cfg.action_format == "index"
        parsed = [parse_action(g.text, st.admissible[e], by_index=by_index) for e, g in zip(active, gens)]
        outs = _env_call(st, pool.step, active, [pa.action for pa in parsed])
        for e, g, pa, r in zip(active, gens, parsed, outs):
            _record_step(st, e, t, g, pa, to_env_out(r, is_reset=False))
        bar.set_postfix(running=int(st.alive.sum()))
        bar.update(1)
    st.cut_at_horizon = int(st.alive.sum())  # still running after H steps (env budget > H)
    st.alive[:] = False


def _revise(policy: Policy, st: _State, cfg: RolloutConfig, active: list[int], t: int) -> None:
    """Revision r = t // K - 1 of every running trajectory, in one "strategy" call."""
    r = t // cfg.revise_every - 1
    words = prompts.STRATEGY_WORDS if cfg.strategy_budget is None else max(cfg.strategy_budget * 3 // 4, 1)
    msgs = revision_mod.revision_prompts(st, active, t, cfg, words)
    gens = _generate(policy, st, msgs, "strategy", [(*st.pnm(e), r) for e in active])
    revision_mod.apply_revisions(st.rev, active, r, t, gens, cfg.strategy_budget)


def _record_step(st: _State, e: int, t: int, g: Generation, pa, r: EnvOut) -> None:
    st.gens[e].append(g)
    st.logs[e].append({"obs": st.obs[e], "output": g.text, "action": pa.action, "reason": pa.reason})
    if r.crashed:
        st.crashed[e], st.alive[e], st.errors[e] = True, False, r.error
        return
    st.step_mask[e, t], st.invalid[e, t] = True, not pa.valid
    if not pa.valid:  # what the command should have started like (penalty_tokens "divergence")
        st.invalid_admissible[(e, t)] = st.admissible[e]
    st.step_slot[e, t] = st.rev.slot[e]
    st.changed[e, t] = judge_mod.state_changed(r.info, r.obs)
    st.anchor_id[e, t] = text_id(st.obs[e])
    st.action_id[e, t] = text_id(pa.action) if pa.valid else -1  # an invalid output has no action
    st.env_reward[e, t] = r.reward
    st.milestone[e, t] = bool(r.info.get("milestone", False))
    st.won[e] = bool(r.info.get("won", False))
    st.length[e] = t + 1
    st.history[e].append((st.obs[e], pa.action))
    st.obs[e] = r.obs
    st.admissible[e] = r.info.get("admissible_commands", st.admissible[e])
    if r.terminated or r.truncated:
        st.alive[e] = False


def _judge(policy: Policy, st: _State, cfg: RolloutConfig) -> dict[str, float]:
    """k = judge_samples judgments per finished trajectory in one call; the strict-majority set is
    penalised (k = 1: the judgment itself). Keys (p, n, m), or (p, n, m, j) when k > 1."""
    done = np.flatnonzero(~st.masked()).tolist()
    J = cfg.judge_samples
    items, where = [], []
    for e in done:
        p, n, m = st.pnm(e)
        z = st.rev.strategy_history(e) if cfg.revise_every else st.z[p][n]
        for j in range(J):
            items.append(
                judge_mod.JudgeItem(
                    key=(p, n, m) if J == 1 else (p, n, m, j), task=st.task_line[p], strategy=z, steps=st.history[e]
                )
            )
            where.append((e, j))
    msgs = judge_mod.judge_prompts(items, cfg.judge_excerpt_chars)
    gens = _generate(policy, st, msgs, "judge", [it.key for it in items]) if items else []
    verdicts = judge_mod.verdicts(items, gens)
    fails = 0
    texts: dict[int, list[str]] = {}
    for (e, j), g, v in zip(where, gens, verdicts):
        texts.setdefault(e, []).append(v.text)
        fails += not v.ok
        st.judge_valid[e, j], st.judge_ok[e, j] = True, v.ok
        st.judge_gens[(e, j)] = g
        for k in v.bad:
            st.judge_sets[e, j, k - 1] = True
    for e in done:
        st.judge_texts[st.pnm(e)] = texts[e][0] if J == 1 else texts[e]
    st.judged_bad[:] = judge_mod.majority(st.judge_sets, st.judge_ok)
    return {
        "judge_calls": float(len(items)),
        "judge_parse_fail": float(fails),
        "judge_parse_fail_rate": fails / max(len(items), 1),
        "judged_bad_steps": float(st.judged_bad.sum()),
    }


# --- batches --------------------------------------------------------------------------------------


def bucket(n: int, buckets: Sequence[int] | None, minimum: int = 16) -> int:
    """Smallest configured bucket >= n (None: the next power of two >= max(n, minimum))."""
    if buckets is None:
        return 1 << (max(int(n), minimum, 1) - 1).bit_length()
    b = smallest_bucket(n, buckets)
    if b is not None:
        return b
    raise ValueError(
        f"a token row of {n} tokens exceeds the largest length bucket {max(buckets)}; "
        "raise train.length_buckets or shorten prompts / token budgets"
    )


def _traj_batch(st: _State, cfg: RolloutConfig) -> TrajectoryBatch:
    masked = st.masked()
    keep = ~masked[:, None]
    shape = (st.P, st.N, st.M, st.H)
    step = lambda a: np.where(keep, a, np.zeros_like(a)).reshape(shape)  # noqa: E731
    ids = lambda a: np.where(keep, a, -1).reshape(shape)  # noqa: E731
    won = st.won & ~masked
    ret = cfg.r_succ * won
    if cfg.env_reward_in_return:
        ret = ret + np.where(keep, st.env_reward, 0).sum(axis=1)
    strategy_len = np.zeros((st.P, st.N), np.int32)
    for p in range(st.P):
        for n in range(st.N):
            g = st.z_gen[p][n]
            strategy_len[p, n] = 0 if g is None else len(g.response_ids)
    R, J = cfg.num_revisions, cfg.num_judgments
    per = lambda a, k: np.where(keep, a, np.zeros_like(a)).reshape(shape[:3] + k)  # noqa: E731  [E, k] -> [P,N,M,k]
    rev_len = np.zeros((st.E, R), np.int32)
    for (e, r), g in st.rev.gens.items():
        rev_len[e, r] = len(g.response_ids)
    labels = judge_mod.step_labels(st.step_mask, st.milestone, st.invalid, st.action_id, st.changed)
    return TrajectoryBatch.from_numpy(
        step_mask=step(st.step_mask),
        won=won.reshape(shape[:3]),
        episode_return=ret.astype(np.float32).reshape(shape[:3]),
        env_reward=step(st.env_reward),
        invalid=step(st.invalid),
        milestone=step(st.milestone),
        judged_bad=step(st.judged_bad),
        anchor_id=ids(st.anchor_id),
        action_id=ids(st.action_id),
        strategy_mask=_strategy_mask(st),
        strategy_len=strategy_len,
        strategy_malformed=st.z_malformed & _strategy_mask(st),
        horizon=st.horizon,
        step_slot=step(st.step_slot),
        step_label=step(labels),
        revision_mask=per(st.rev.mask, (R,)),
        revision_len=per(rev_len, (R,)),
        revision_malformed=per(st.rev.malformed, (R,)),
        judge_valid=per(st.judge_valid, (J,)),
        judge_ok=per(st.judge_ok, (J,)),
        judge_sets=np.where(keep[:, :, None], st.judge_sets, False).reshape(shape[:3] + (J, st.H)),
    )


def _strategy_mask(st: _State) -> np.ndarray:
    """[P, N]: a kept strategy with at least one trajectory in the batch."""
    has_traj = (~st.masked()).reshape(st.P, st.N, st.M).any(axis=-1)
    return st.z_kept & has_traj


def _token_rows(st: _State, cfg: RolloutConfig) -> list[tuple[Generation, tuple[int, int, int, int]]]:
    """Every trained LLM call: kept strategies (t = -1) and revisions (t = -2 - r), then every step
    (t) and, with judge_train, every judgment (t = H + j) of every batch trajectory, ordered by
    (t >= 0, p, n, m, t) as rollout/shards.py merges shards."""
    rows = []
    smask = _strategy_mask(st)
    for p, n in zip(*np.nonzero(smask)):
        rows.append((st.z_gen[p][n], (int(p), int(n), 0, -1)))
    masked = st.masked()
    for (e, r), g in st.rev.gens.items():
        if not masked[e]:
            rows.append((g, (*st.pnm(e), -2 - r)))
    for e in range(st.E):
        if masked[e]:
            continue
        p, n, m = st.pnm(e)
        rows += [(g, (p, n, m, t)) for t, g in enumerate(st.gens[e][: st.length[e]])]
    if cfg.judge_train:
        rows += [(g, (*st.pnm(e), st.H + j)) for (e, j), g in st.judge_gens.items() if not masked[e]]
    ri = np.asarray([idx for _, idx in rows], np.int64).reshape(-1, 4)
    order = np.lexsort((ri[:, 3], ri[:, 2], ri[:, 1], ri[:, 0], ri[:, 3] >= 0)) if rows else []
    return [rows[i] for i in order]


def penalty_token_mask(
    g: Generation, reason: str | None, decode: Any, mode: str, admissible: Sequence[str] | None = None
) -> np.ndarray:
    """[len(response)] bool: the response tokens an invalid step's penalty lands on (see
    RolloutConfig.penalty_tokens). The action content is located in the decoded response and mapped
    to tokens through the decoded length of every token prefix.

    mode "divergence" (an inadmissible command, `admissible` = the step's command list): the first
    content token after which the content, normalised as the parser does, is no longer the start
    of any admissible command. A content that is a strict start of one ("go to cab") was cut
    short: the first token after it (the closing tag) is the wrong one. Without a list, or a
    too-long command, it falls back to "action"."""
    n = len(g.response_ids)
    whole = np.ones(n, bool)
    if mode == "response" or reason not in (INADMISSIBLE, TOO_LONG):
        return whole
    if decode is None:
        raise ValueError(
            f"invalid_penalty_tokens={mode!r} needs a policy with decode(ids) -> str to find the "
            "action's tokens; this policy has none (use 'response')"
        )
    ids = [int(i) for i in g.response_ids]
    text = decode(ids)
    span = action_content_span(text)
    if span is None:
        return whole
    ends = np.fromiter((len(decode(ids[: i + 1])) for i in range(n)), np.int64, n)  # char end of token i
    starts = np.concatenate([[0], ends[:-1]])
    out = (starts < span[1]) & (ends > span[0])  # token overlaps the content
    if not out.any():
        return whole
    if mode == "divergence" and reason == INADMISSIBLE and admissible:
        cmds = [normalize_action(c) for c in admissible]
        for i in np.flatnonzero(out):
            # the content up to the end of token i, normalised (a trailing space stays: "go to "
            # is the start of "go to desk 1", "goto" is not the start of anything)
            prefix = text[span[0] : min(int(ends[i]), span[1])]
            norm = normalize_action(prefix) + (" " if prefix[-1:].isspace() else "")
            if not any(c.startswith(norm) for c in cmds):
                return np.arange(n) == i
        after = np.flatnonzero(starts >= span[1])  # the content is a strict start: it stopped early
        if len(after):
            return np.arange(n) == after[0]
    return out


def _penalty_mask(st: _State, rows: list, packed: dict, decode: Any, cfg: RolloutConfig) -> np.ndarray:
    """[R, L] bool, aligned with the packed rows (each row ends with its response)."""
    mask = np.zeros_like(packed["loss_mask"])
    length = mask.shape[1]
    for s, (g, (p, n, m, t)) in enumerate(rows):
        if not 0 <= t < st.H:  # strategies, revisions and judgments carry no invalid penalty
            continue
        e = (p * st.N + n) * st.M + m
        if not st.invalid[e, t]:
            continue
        k = len(g.response_ids)
        mask[s, length - k :] = penalty_token_mask(
            g, st.logs[e][t]["reason"], decode, cfg.penalty_tokens, st.invalid_admissible.get((e, t))
        )
    return mask


def _token_batch(st: _State, cfg: RolloutConfig, decode: Any = None) -> TokenBatch:
    rows = _token_rows(st, cfg)
    longest = max((len(g.prompt_ids) + len(g.response_ids) for g, _ in rows), default=1)
    length = bucket(longest, cfg.length_buckets)
    num_rows = max(-(-len(rows) // cfg.row_multiple), 1) * cfg.row_multiple
    packed = pad_token_rows(
        [g.prompt_ids for g, _ in rows],
        [g.response_ids for g, _ in rows],
        [g.logprobs for g, _ in rows],
        length,
        num_rows,
        cfg.pad_id,
    )
    row_index = np.zeros((num_rows, 4), np.int32)
    row_index[: len(rows)] = [idx for _, idx in rows] if rows else np.zeros((0, 4), np.int32)
    zeros = np.zeros((num_rows, length), np.float32)
    return TokenBatch(
        tokens=packed["tokens"],
        attention_mask=packed["attention_mask"],
        loss_mask=packed["loss_mask"],
        old_logp=packed["old_logp"],
        ref_logp=zeros,
        advantage=zeros.copy(),
        row_index=row_index,
        row_valid=packed["row_valid"],
        penalty_mask=_penalty_mask(st, rows, packed, decode, cfg),
    )


# --- entry point ----------------------------------------------------------------------------------


def collect(envs: Any, policy: Policy, tasks: Sequence[int], cfg: RolloutConfig) -> RolloutResult:
    """One rollout iteration over `tasks` (P task seeds). See the module docstring.

    `envs`: a pool with batched `reset(env_indices, seeds)` / `step(env_indices, actions)` and at
    least P*N*M envs, or a list of TextEnvs (run serially in-process).
    TokenBatch arrays are host numpy (the trainer places them with its shardings); ref_logp and
    advantage are zeros for the trainer to fill.
    """
    cfg.validate()
    # The iteration allocates ~10^5 small objects (texts, generations); cyclic GC passes over them
    # cost up to a third of the non-policy time, and nothing here creates cycles that matter.
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        return _collect(envs, policy, tasks, cfg)
    finally:
        if gc_was_on:
            gc.enable()


def _collect(envs: Any, policy: Policy, tasks: Sequence[int], cfg: RolloutConfig) -> RolloutResult:
    t0 = time.perf_counter()
    pool = as_pool(envs)
    st = _State(tasks, cfg)
    if pool.num_envs < st.E:
        raise ValueError(f"the pool has {pool.num_envs} envs; P*N*M = {st.P}*{st.N}*{st.M} = {st.E} needed")
    # The bar from the start: resets and the strategy call (the first compiles) can take minutes.
    with progress(
        total=st.H,
        desc="rollout steps",
        enabled=cfg.progress,
        unit="step",
        leave=False,
        postfix=f"resetting {st.E} episodes of {st.P} tasks",
    ) as bar:
        _reset(pool, st)
        if cfg.mode == "strata":
            k = cfg.oversample * st.N
            bar.status(f"sampling {k} strateg{'y' if k == 1 else 'ies'} per task")
            _strategies(policy, st, cfg)
        _run_steps(pool, policy, st, cfg, bar)
        if cfg.judgment:
            bar.status(f"judging {int((~st.masked()).sum())} trajectories")
        stats = _judge(policy, st, cfg) if cfg.judgment else {}
    t_build = time.perf_counter()
    traj, tokens = _traj_batch(st, cfg), _token_batch(st, cfg, getattr(policy, "decode", None))
    build_s = time.perf_counter() - t_build
    stats.update(_stats(st, tokens))
    total = time.perf_counter() - t0
    stats.update(
        time_s=total,
        policy_time_s=st.policy_s,
        env_time_s=st.env_s,
        build_time_s=build_s,
        non_policy_share=1.0 - st.policy_s / max(total, 1e-9),
    )
    return RolloutResult(traj=traj, tokens=tokens, stats=stats, texts=_texts(st))


def _stats(st: _State, tokens: TokenBatch) -> dict[str, float]:
    in_batch = ~st.masked()
    steps = st.step_mask & in_batch[:, None]
    invalid = st.invalid & steps
    out = {
        "trajectories": float(st.E),
        "crashed": float(st.crashed.sum()),
        "unrun": float((~st.crashed & ~in_batch).sum()),
        "cut_at_horizon": float(st.cut_at_horizon),
        "in_batch": float(in_batch.sum()),
        "steps": float(steps.sum()),
        "invalid": float(invalid.sum()),
        "invalid_rate": float(invalid.sum()) / max(float(steps.sum()), 1.0),
        "success_rate": float(st.won[in_batch].mean()) if in_batch.any() else 0.0,
        "mean_episode_len": float(st.length[in_batch].mean()) if in_batch.any() else 0.0,
        "milestones": float((st.milestone & steps).sum()),
        "strategies": float(_strategy_mask(st).sum()),
        "strategy_malformed": float((st.z_malformed & _strategy_mask(st)).sum()),
        "sampled_tokens": float(st.sampled_tokens),
        "rows": float(np.asarray(tokens.row_valid).sum()),
        "rows_padded": float(tokens.tokens.shape[0]),
        "row_length": float(tokens.tokens.shape[1]),
    }
    if st.rev.R:  # only runs that revise report it (the metrics rows of other runs are unchanged)
        out["revisions"] = float(st.rev.mask[in_batch].sum())
        out["revision_malformed"] = float((st.rev.mask & st.rev.malformed)[in_batch].sum())
    reasons = {r: 0 for r in INVALID_REASONS}
    for e in np.flatnonzero(in_batch):
        for t in np.flatnonzero(invalid[e]):
            reasons[st.logs[e][t]["reason"]] += 1
    out.update({f"invalid/{r}": float(c) for r, c in reasons.items()})
    return out


def _texts(st: _State) -> dict[str, Any]:
    trajs = []
    for e in range(st.E):
        p, n, m = st.pnm(e)
        trajs.append(
            {
                "key": (p, n, m),
                "task": st.task_line[p],
                "strategy": st.z[p][n],
                "won": bool(st.won[e]),
                "crashed": bool(st.crashed[e]),
                "error": st.errors[e],
                "steps": st.logs[e],
                "judge": st.judge_texts.get((p, n, m)),
                "revisions": st.rev.log[e],
            }
        )
    return {"candidates": st.candidates, "strategies": st.z, "trajectories": trajs}
