"""Expert demonstrations for the SFT warm start, produced through the real rollout path.

An expert "policy" answers every call of `collect` (strategy, actions, judgment) from an
environment's expert solver (household, shop: `EXPERTS`), so demonstration prompts are
byte-for-byte the prompts RL will show the model. `ExpertPolicy` tokenizes with the real tokenizer;
`corpus` (for training the tiny model's tokenizer before it exists) uses the scripted policy's fake
ids and keeps the texts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout.collect import RolloutConfig, collect
from rollout.envs.base import TextEnv
from rollout.envs.doors import LOCKED
from rollout.envs.household import HouseholdEnv, solve
from rollout.envs.shop import ShopEnv
from rollout.envs.shop import expert_plan as shop_plan
from rollout.envs.shop import expert_strategy as shop_strategy
from rollout.policy import Generation, Messages, ScriptedPolicy, check_kind, fake_embedding, render
from rollout.prompts import numbered_commands

THINK = "<think>I follow my strategy.</think>"


def strategy_text(plan: Sequence[str]) -> str:
    """The expert's strategy: its plan's commands in order, spelled as the environment spells them.

    Each step then copies the next command of the strategy. A shortened summary ('take apple 1'
    for 'take apple 1 from countertop 1') makes the step complete it from the admissible list
    instead, which the tiny default model learns about half as fast in SFT.
    """
    return ", then ".join(plan)


def household_expert(seed: int, env_kwargs: dict) -> tuple[list[str], str]:
    plan = solve(seed, **env_kwargs)
    return plan, strategy_text(plan)


def shop_expert(seed: int, env_kwargs: dict) -> tuple[list[str], str]:
    """The shop's plan, and a strategy that names the item by what the results show, not by the id
    the expert knows but the model cannot before it has searched (rollout/envs/shop.py)."""
    env = ShopEnv(**env_kwargs)
    env.reset(seed=seed)
    return shop_plan(env), shop_strategy(env)


def household_kwargs(config: Any) -> dict:
    """HouseholdEnv arguments of a run config (the trainer's environments use the same)."""
    e = config.env
    return {
        "max_steps": int(e.max_steps),
        "horizon": (int(e.horizon_min), int(e.horizon_max)),
        "n_extra_receptacles": int(e.extra_receptacles),
        "n_distractors": int(e.distractors),
        "reveal_objects": bool(e.reveal_objects),
    }


def shop_kwargs(config: Any) -> dict:
    """ShopEnv arguments of a run config."""
    e = config.env
    return {
        "max_steps": int(e.max_steps),
        "horizon": (int(e.horizon_min), int(e.horizon_max)),
        "catalog_seed": int(e.shop_catalog_seed),
        "num_products": int(e.shop_products),
        "page_size": int(e.shop_page_size),
    }


@dataclass(frozen=True)
class Expert:
    """An environment with an expert solver: how to build it from a config and solve a task."""

    env_cls: type[TextEnv]
    kwargs: Callable[[Any], dict]  # run config -> env constructor arguments
    # (seed, env kwargs) -> (plan, strategy); None: the demonstrator is a script of its own (doors)
    solve: Callable[[int, dict], tuple[list[str], str]] | None


def _doors_env(**kw) -> TextEnv:
    from rollout.envs.doors import DoorsEnv

    return DoorsEnv(**kw)


def doors_kwargs(config: Any) -> dict:
    e = config.env
    return {
        "max_steps": int(e.max_steps),
        "doors": (int(e.horizon_min), int(e.horizon_max)),
        "options": int(e.doors_options),
        "sign_at": int(e.doors_sign_at),
    }


EXPERTS = {
    "household": Expert(HouseholdEnv, household_kwargs, household_expert),
    "shop": Expert(ShopEnv, shop_kwargs, shop_expert),
    "doors": Expert(_doors_env, doors_kwargs, None),
}


def expert_for(config: Any) -> Expert:
    """The run's environment's expert. Environments without one (ALFWorld, ScienceWorld) warm-start
    on household demonstrations: the household world speaks ALFWorld's language (tiny_alfworld)."""
    return EXPERTS.get(config.env.name, EXPERTS["household"])


def expert_env_kwargs(config: Any) -> dict:
    """Constructor arguments of the run's environment, for the environments with an expert."""
    return expert_for(config).kwargs(config)


def expert_script(
    tasks: Sequence[int], env_kwargs: dict, env_name: str = "household", epsilon: float = 0.0, seed: int = 0
) -> Callable[[Messages, str, Hashable], str]:
    """script(messages, kind, key) -> the expert's answer; keys as `collect` passes them.

    epsilon > 0 (household only): an epsilon-soft expert. Before each plan step, with probability
    epsilon, it takes a harmless detour instead (`look`, `inventory` or `go to` another receptacle)
    and then recovers: after a `go to` detour it first walks back, unless its next command is a
    `go to` itself. The demonstrations then carry entropy (a policy that imitates them still
    explores) and show how to recover from a wrong move, and every detour is a known bad step,
    which the expert's self-judgment lists (instead of always answering 'none').
    """
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon={epsilon} must be in [0, 1]")
    if epsilon and env_name != "household":
        raise ValueError(f"epsilon-soft demonstrations are built for the household world, not {env_name!r}")
    expert = EXPERTS.get(env_name, EXPERTS["household"])
    if expert.solve is None:
        return doors_script(tasks, seed, int(env_kwargs.get("sign_at", 0)))
    solved = {p: expert.solve(task_seed, env_kwargs) for p, task_seed in enumerate(tasks)}
    rooms, starts = {}, {}
    if epsilon:  # the detours need the room's receptacles and where the agent starts
        for p, task_seed in enumerate(tasks):
            env = HouseholdEnv(**env_kwargs)
            env.reset(seed=task_seed)
            rooms[p], starts[p] = sorted(env.world.rtype), env.world.at
    walks: dict[Hashable, _Walk] = {}

    def walk(p: int, key: Hashable) -> _Walk:
        if key not in walks:
            walks[key] = _Walk(
                solved[p][0],
                rooms.get(p, []),
                starts.get(p),
                epsilon,
                np.random.default_rng([int(seed), *(int(k) for k in key)]),
            )
        return walks[key]

    def script(messages: Messages, kind: str, key: Hashable) -> str:
        if kind == "strategy":  # at reset (p, k) and at a revision (p, n, m, r): the expert keeps its plan
            return f"<strategy>{solved[key[0]][1]}</strategy>"
        if kind == "action":
            p, n, m, t = key
            cmd = walk(p, (p, n, m)).next_action()
            if "Admissible actions: [" in messages[-1]["content"]:  # env.action_format="index"
                numbers = numbered_commands(messages[-1]["content"])
                if cmd not in numbers:
                    raise RuntimeError(f"the expert's command {cmd!r} is not in the numbered admissible list")
                cmd = str(numbers[cmd])
            return f"{THINK}<action>{cmd}</action>"
        w = walks.get(tuple(key[:3]))  # judge keys: (p, n, m), or (p, n, m, j) with several samples
        bad = w.detours if w is not None else []
        return f"<bad_steps>{', '.join(map(str, bad)) if bad else 'none'}</bad_steps>"

    return script


class _Walk:
    """One demonstration trajectory of the epsilon-soft expert (see expert_script)."""

    def __init__(self, plan: list[str], rooms: list[str], start: str | None, epsilon: float, rng: np.random.Generator):
        self.plan, self.rooms, self.loc, self.eps, self.rng = plan, rooms, start, epsilon, rng
        self.i = 0  # next plan command
        self.t = 0  # steps taken
        self.back: str | None = None  # receptacle to walk back to after a detour
        self.detours: list[int] = []  # 1-based step numbers of the detours

    def next_action(self) -> str:
        self.t += 1
        if self.back is not None:
            action, self.back = f"go to {self.back}", None
        elif self.i < len(self.plan) and self.eps > 0 and self.rng.random() < self.eps:
            action = self._detour()
        elif self.i < len(self.plan):
            action = self.plan[self.i]
            self.i += 1
        else:
            action = "look"
        if action.startswith("go to "):
            self.loc = action[len("go to ") :]
        return action

    def _detour(self) -> str:
        nxt = self.plan[self.i]
        goes = nxt.startswith("go to ")
        options = ["look", "inventory"]
        # a walk away needs a way back: from the middle of the room the next command is a go-to
        if goes or self.loc is not None:
            options += [f"go to {r}" for r in self.rooms if r != self.loc and nxt != f"go to {r}"]
        action = options[int(self.rng.integers(len(options)))]
        if action.startswith("go to ") and not goes:
            self.back = self.loc
        self.detours.append(self.t)
        return action


DOORS_STRATEGY = "find the door that opens, then take it every time."
_SIGN = re.compile(r"A sign here reads: (\w+)\.")  # rollout/envs/doors.py's signpost
_TAKE = re.compile(r"Your strategy for this episode: (\w+) doors from here on")
_AT = re.compile(r"Current observation \(step \d+\):.*?You are at door (\d+) of")
_SO_FAR = re.compile(r"Your strategy so far: (.*)")
_JUDGED_STEP = re.compile(r"^(\d+)\. Observation: (.*?) \| Action:", re.M)  # rollout/prompts.py judge_prompt


def doors_bad_steps(judge_text: str) -> list[int]:
    """The steps of a judge prompt whose door stayed shut: those followed by an observation that
    starts with the doors world's "The door is locked." (the last step's outcome is not in the
    prompt, so it is never listed). A shut door changed nothing and advanced nothing."""
    steps = {int(n): obs for n, obs in _JUDGED_STEP.findall(judge_text)}
    return [n for n in sorted(steps) if steps.get(n + 1, "").startswith(LOCKED)]


def doors_script(tasks: Sequence[int], seed: int = 0, sign_at: int = 0) -> Callable[[Messages, str, Hashable], str]:
    """The doors world's demonstrator: the right format and a uniformly random listed door. A policy
    that imitates it is valid but weak (two doors per step, two steps: it wins 1/4 of the time);
    only RL can teach it which door opens (the learnability tests).

    The signpost corridor (`sign_at > 0`, the strategy-revision study) has a demonstrator of its
    own, so that what RL has left to learn is which revision to write:
    - before the sign (doors 1..sign_at) it takes the red door, so it reaches the sign;
    - a step whose strategy or current observation names a colour takes that door; other steps
      take a random listed door;
    - at a revision it names the colour of a sign in view in half of its answers (by the call's
      key) and keeps the strategy in force in the other half. Imitating that, the warm start
      writes a useful revision about half the time: GRPO over the revisions (docs/CONTRACTS.md)
      has both kinds in a group to compare.
    """

    def script(messages: Messages, kind: str, key: Hashable) -> str:
        text = messages[-1]["content"]
        rng = np.random.default_rng([int(seed), *(int(k) for k in key)])
        if kind == "strategy":  # the reset strategy (key (p, k)) and every revision (key (p, n, m, r))
            sign, so_far = _SIGN.search(text), _SO_FAR.search(text)
            if sign and (not so_far or rng.random() < 0.5):
                # the colour first, right after the prompt's "strategy for this episode:" (see doors.py)
                return f"<strategy>{sign.group(1)} doors from here on.</strategy>"
            return f"<strategy>{so_far.group(1).strip() if so_far else DOORS_STRATEGY}</strategy>"
        if kind == "judge":  # what the prompt shows: the steps after which the door stayed shut
            bad = doors_bad_steps(text)
            return f"<bad_steps>{', '.join(map(str, bad)) if bad else 'none'}</bad_steps>"
        doors = re.findall(r"'(open the \w+ door)'", text)
        at = _AT.search(text)
        named = _SIGN.search(text) or _TAKE.search(text)
        if sign_at and named and f"open the {named.group(1)} door" in doors:
            return f"{THINK}<action>open the {named.group(1)} door</action>"
        if sign_at and at and int(at.group(1)) <= sign_at and "open the red door" in doors:
            return f"{THINK}<action>open the red door</action>"
        return f"{THINK}<action>{doors[int(rng.integers(len(doors)))] if doors else 'look'}</action>"

    return script


class ExpertPolicy:
    """A Policy with real token ids: prompt rendered with the chat template, response = script text.

    Judge calls are answered too and kept in `judge_rows` (collect does not put judgment rows in
    the TokenBatch), so SFT can teach the <bad_steps> format.
    """

    def __init__(self, tokenizer: Any, script: Callable[[Messages, str, Hashable], str], embed_dim: int = 8):
        self.tokenizer, self.script, self.embed_dim = tokenizer, script, embed_dim
        self.judge_rows: list[tuple[np.ndarray, np.ndarray]] = []

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def generate(self, prompts: list[Messages], kind: str, keys: Sequence[Hashable] | None = None) -> list[Generation]:
        check_kind(kind)
        keys = list(range(len(prompts))) if keys is None else list(keys)
        out = []
        for messages, key in zip(prompts, keys):
            text = self.script(messages, kind, key)
            prompt = np.asarray(
                self.tokenizer.encode(render(messages, self.tokenizer), add_special_tokens=False), np.int32
            )
            resp = np.asarray(self.tokenizer.encode(text, add_special_tokens=False), np.int32)
            if kind == "judge":
                self.judge_rows.append((prompt, resp))
            out.append(
                Generation(
                    text=text,
                    prompt_ids=prompt,
                    response_ids=resp,
                    logprobs=np.zeros(len(resp), np.float32),
                    embedding=fake_embedding(text, self.embed_dim),
                    finish_reason="stop",
                )
            )
        return out


def demo_rollout_config(config: Any) -> RolloutConfig:
    """One expert trajectory per task, in the run's own mode (strategy prompt included for StraTA)."""
    import dataclasses

    cfg = RolloutConfig.from_config(config)
    # one judgment per task: the demonstrations' verdicts are rows of their own (ExpertPolicy)
    return dataclasses.replace(
        cfg,
        group_size=1,
        num_strategies=1,
        traj_per_strategy=1,
        oversample=1,
        diverse=False,
        judgment=True,
        judge_samples=1,
        judge_train=False,
        progress=False,
        length_buckets=None,
        row_multiple=8,
    )


def corpus(config: Any, num_tasks: int = 96, seed_offset: int = 0) -> list[str]:
    """Prompt and answer texts of expert episodes: what the tiny model's tokenizer is trained on."""
    expert = expert_for(config)
    kw = expert.kwargs(config)
    tasks = list(range(seed_offset, seed_offset + num_tasks))
    texts: list[str] = []
    base = expert_script(tasks, kw, config.env.name)

    def recording(messages, kind, key):
        answer = base(messages, kind, key)
        texts.extend(m["content"] for m in messages)
        texts.append(answer)
        return answer

    envs = [expert.env_cls(**kw) for _ in range(num_tasks)]
    collect(envs, ScriptedPolicy(recording), tasks, demo_rollout_config(config))
    return texts


def sft_rows(
    config: Any, tokenizer: Any, tasks: Sequence[int], judge_share: float = 1.0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt_ids, response_ids) of every expert call on `tasks`: strategies, actions, and the
    judgments of the first `judge_share` of the tasks (the expert's verdict is always 'none', a
    format learnt from a few rows; long judge prompts would otherwise cost a sixth of SFT)."""
    if not 0.0 <= judge_share <= 1.0:
        raise ValueError(f"judge_share={judge_share} must be in [0, 1]")
    styles = str(config.sft.styles)
    if styles == "both":
        # One checkpoint that starts every algorithm (the learning study's shared SFT): the
        # strategy-conditioned rows of StraTA plus the flat step prompts of GRPO / GiGPO / BEACON.
        import copy

        strata, flat = copy.deepcopy(config), copy.deepcopy(config)
        strata.algo.name, strata.algo.judgment, strata.sft.styles = "strata", True, "own"
        flat.algo.name, flat.algo.judgment, flat.sft.styles = "grpo", False, "own"
        flat.algo.revise_every = 0  # a flat prompt has no strategy to revise
        return sft_rows(strata, tokenizer, tasks, judge_share) + sft_rows(flat, tokenizer, tasks, judge_share)
    if styles != "own":
        raise ValueError(f"config.sft.styles={styles!r}: choose 'own' or 'both'")
    expert = expert_for(config)
    kw = expert.kwargs(config)
    policy = ExpertPolicy(
        tokenizer, expert_script(list(tasks), kw, config.env.name, float(config.sft.epsilon), int(config.seed))
    )
    cfg = demo_rollout_config(config)
    envs = [expert.env_cls(**kw) for _ in range(len(tasks))]
    res = collect(envs, policy, list(tasks), cfg)
    tb = res.tokens
    rows = []
    for s in np.flatnonzero(np.asarray(tb.row_valid)):
        tok, att, loss = (np.asarray(a[s]) for a in (tb.tokens, tb.attention_mask, tb.loss_mask))
        rows.append((tok[att & ~loss], tok[loss]))
    # judge calls are made in task order, one per task
    return rows + policy.judge_rows[: int(round(judge_share * len(policy.judge_rows)))]
