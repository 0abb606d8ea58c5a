"""StraTA end to end on REAL ALFWorld games, checked against expectations computed here.

1. `launch.py train --config configs/tiny_alfworld.py` for one iteration, shrunk for CI: P=2 games of
   valid_seen, N=2 strategies x M=2 trajectories, H=5 steps, evaluation on 2 valid_unseen games,
   the tiny model built and SFT'd (3 steps) inside the run. Only eval.tar.xz is unpacked (valid_seen
   140 + valid_unseen 134 games, 25 MB, < 1 s); train.tar.xz (317 MB, ~7000 files) is not needed.
   The trainer saves the TrajectoryBatch but not the rollout texts, so the subprocess runs
   launch.py's own `__main__` behind a tap that appends every `collect` call's task seeds and texts
   (observations, outputs, the commands sent) to a JSONL file; nothing else is changed.
   Checked: batch shapes, that every trajectory is in the batch or counted as crashed, L* from the
   games' traj_data.json, the metrics row, and a replay of every logged command in a fresh
   AlfWorldEnv: observations, anchor / action ids (recomputed from blake2b + np.unique), invalid
   flags, wins, and facts-based milestones recomputed here from the engine's PDDL facts.
2. The same replay check on scripted trajectories that do win, hit milestones, send invalid outputs
   and crash (the tiny model of 1. mostly emits invalid actions, so its milestones are all zero).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
P, N, M, H = 2, 2, 2, 5
TRAIN_SPLIT, EVAL_SPLIT = "valid_seen", "valid_unseen"

# 1 iteration, 2 games x 2 strategies x 2 trajectories x 5 steps; the tiny model shrunk further and
# SFT'd for 3 steps (enough to exercise the path, not to play well).
RUN = [
    "--config.iterations=1",
    "--config.algo.tasks_per_iter=2",
    "--config.algo.num_strategies=2",
    "--config.algo.traj_per_strategy=2",
    "--config.algo.oversample=2",
    f"--config.env.max_steps={H}",
    f"--config.env.split={TRAIN_SPLIT}",
    f"--config.env.eval_split={EVAL_SPLIT}",
    "--config.eval.num_tasks=2",
    "--config.eval.every=1",
    "--config.eval.greedy=False",
    "--config.checkpoint.every=1",
    "--config.train.mini_batch_rows=64",
    "--config.sampling.max_strategy_tokens=16",
    "--config.sampling.max_judge_tokens=8",
    "--config.log.progress=False",
    "--config.log.plots_every=0",
    "--config.model.tiny_hidden=32",
    "--config.model.tiny_layers=1",
    "--config.model.tiny_heads=2",
    "--config.model.tiny_kv_heads=1",
    "--config.model.tiny_intermediate=64",
    "--config.model.tiny_vocab=1024",
    "--config.sft.steps=3",
    "--config.sft.num_tasks=8",
    "--config.sft.batch_rows=8",
]

# Runs launch.py as `python launch.py ...` would, with `collect` wrapped to log its texts.
TAP = r"""
import json, runpy, sys
sys.path.insert(0, {repo!r})
import rollout.evaluate as evaluate, rollout.iteration as iteration
for mod in (iteration, evaluate):
    if not hasattr(mod, "collect"):
        sys.exit(f"{{mod.__name__}} no longer calls `collect` by that name: update the tap in test_alfworld_e2e.py")
_collect = iteration.collect

def tapped(envs, policy, tasks, cfg):
    res = _collect(envs, policy, tasks, cfg)
    with open({out!r}, "a") as f:
        f.write(json.dumps({{"tasks": [int(t) for t in tasks], "n": cfg.n, "m": cfg.m, "max_steps": cfg.max_steps,
                             "judgment": cfg.judgment, "stats": res.stats, "texts": res.texts}}, default=str) + "\n")
    return res

iteration.collect = evaluate.collect = tapped
sys.argv = [{launch!r}, *sys.argv[1:]]
runpy.run_path({launch!r}, run_name="__main__")
"""


# --------------------------------------------------------------------------------------------
# independent expectations: game listing, ids, goal-fact milestones


def list_split(data: pathlib.Path, split: str) -> list[str]:
    """Game folders of a split, sorted (AlfredTWEnv's filter: no 'movable' / 'Sliced' folders)."""
    root = data / "json_2.1.1"
    out = []
    for dirpath, _, files in os.walk(root / split):
        if {"traj_data.json", "game.tw-pddl"} <= set(files) and "movable" not in dirpath and "Sliced" not in dirpath:
            out.append(os.path.relpath(dirpath, root))
    return sorted(out)


def traj_data(data: pathlib.Path, game: str) -> dict:
    return json.loads((data / "json_2.1.1" / game / "traj_data.json").read_text())


def blake_id(text: str) -> int:
    """The documented stable id of a text: blake2b-64, little endian, top bit cleared."""
    d = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(d, "little") & 0x7FFF_FFFF_FFFF_FFFF


def dense(hashes: np.ndarray) -> np.ndarray:
    """CONTRACTS.md: int64 hashes relabelled to dense int32 ids with np.unique, negatives -> -1."""
    out = np.full(hashes.shape, -1, np.int32)
    ok = hashes >= 0
    if ok.any():
        out[ok] = np.unique(hashes[ok], return_inverse=True)[1]
    return out


TRANSFORM = {
    "pick_heat_then_place_in_recep": "ishot",
    "pick_cool_then_place_in_recep": "iscool",
    "pick_clean_then_place_in_recep": "isclean",
}


class GoalProgress:
    """ALGORITHMS.md section 4 from the PDDL facts: how far each goal fact has got.

    Progress = (distinct targets ever held, capped at the number to place; any target transformed;
    any target sliced; the toggle target on; targets in a parent receptacle, capped). A step is a
    milestone iff some component reaches a value it never had before (initial facts do not count).
    """

    def __init__(self, traj: dict, facts):
        p, ttype = traj["pddl_params"], traj["task_type"]
        typ = {
            f.arguments[0].name: f.arguments[1].name.lower().removesuffix("type")
            for f in facts
            if f.name in ("objecttype", "receptacletype")
        }
        of = lambda t: {o for o, v in typ.items() if t and v == t.lower()}  # noqa: E731
        self.targets, self.parents = of(p["object_target"]), of(p["parent_target"])
        self.toggles = of(p["toggle_target"])
        assert self.targets, f"no object of type {p['object_target']} in the game"
        self.need = 2 if ttype == "pick_two_obj_and_place" else 1
        self.transform, self.sliced = TRANSFORM.get(ttype), bool(p["object_sliced"])
        self.ever_held: set[str] = set()
        self.best = self._progress(facts)

    def _progress(self, facts) -> tuple[int, ...]:
        rel = collections.defaultdict(set)
        for f in facts:
            rel[f.name].add(tuple(a.name for a in f.arguments))
        self.ever_held |= {o for _, o in rel["holds"] if o in self.targets}
        ok = {
            o
            for o in self.targets
            if (not self.transform or (o,) in rel[self.transform]) and (not self.sliced or (o,) in rel["issliced"])
        }
        placed = sum(1 for o, r in rel["inreceptacle"] if o in ok and r in self.parents)
        return (
            min(len(self.ever_held), self.need),
            int(bool(self.transform) and any((o,) in rel[self.transform] for o in self.targets)),
            int(self.sliced and any((o,) in rel["issliced"] for o in self.targets)),
            int(any((o,) in rel["istoggled"] for o in self.toggles)),
            min(placed, self.need) if self.parents else 0,
        )

    def step(self, facts) -> bool:
        now = self._progress(facts)
        grew = any(a > b for a, b in zip(now, self.best))
        self.best = tuple(max(a, b) for a, b in zip(now, self.best))
        return grew


def replay(
    data: pathlib.Path, split: str, tasks: list[int], trajectories: list[dict], batch: dict | None, h: int
) -> dict:
    """Replay every logged trajectory in a fresh AlfWorldEnv; compare with `batch` (if given).

    Returns counts (steps, milestones, wins, invalid, crashed) so callers can check the replay was
    not vacuous.
    """
    from rollout.envs.alfworld import AlfWorldEnv

    games = list_split(data, split)
    env = AlfWorldEnv(data, split=split, max_steps=h)
    shape = batch["step_mask"].shape if batch is not None else (len(tasks), 1, 1, h)
    anchors, actions = np.full(shape, -1, np.int64), np.full(shape, -1, np.int64)
    counts = collections.Counter()
    for tr in trajectories:
        idx = p, n, m = tuple(tr["key"])
        steps = tr["steps"]
        if tr["crashed"]:  # out of the batch entirely, never silently half-kept
            assert batch is None or not (batch["step_mask"][idx].any() or batch["won"][idx]), idx
            counts["crashed"] += 1
            continue
        game = games[tasks[p] % len(games)]
        obs, info = env.reset(seed=tasks[p])
        assert info["task_id"] == game and tr["task"] == info["task"], idx
        goal = GoalProgress(traj_data(data, game), env.state["_facts"])
        assert 1 <= len(steps) <= h, idx
        won = False
        for t, s in enumerate(steps):
            assert s["obs"] == obs, (idx, t)  # the observation the policy saw is the game's
            anchors[p, n, m, t] = blake_id(obs)
            invalid = s["reason"] is not None
            assert invalid == (s["action"] == ""), (idx, t, s)
            if not invalid:
                actions[p, n, m, t] = blake_id(s["action"])
            before = frozenset(map(str, env.state["_facts"]))
            obs, _, won, truncated, info = env.step(s["action"])
            changed = before != frozenset(map(str, env.state["_facts"]))
            expect = goal.step(env.state["_facts"])
            assert not expect or (changed and not invalid), (idx, t)  # only where a goal fact can change
            assert (won or truncated) == (t == len(steps) - 1), (idx, t)  # ends exactly where logged
            if batch is not None:
                assert bool(batch["invalid"][p, n, m, t]) == invalid, (idx, t, s)
                assert bool(batch["milestone"][p, n, m, t]) == expect, (idx, t, s["action"], info["milestone_name"])
            counts["steps"] += 1
            counts["milestones"] += expect
            counts["invalid"] += invalid
        assert won == tr["won"], idx
        counts["wins"] += won
        if batch is not None:
            assert batch["step_mask"][idx].tolist() == [t < len(steps) for t in range(h)], idx
            assert bool(batch["won"][idx]) == won, idx
            assert batch["episode_return"][idx] == pytest.approx(10.0 * won), idx  # r_succ = 10
    if batch is not None:
        np.testing.assert_array_equal(batch["anchor_id"], dense(anchors))
        np.testing.assert_array_equal(batch["action_id"], dense(actions))
    return counts


# --------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def e2e(alf_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("alf_e2e")
    tap_log = work.parent / f"{work.name}_collect.jsonl"
    driver = work.parent / f"{work.name}_driver.py"
    driver.write_text(TAP.format(repo=str(REPO), out=str(tap_log), launch=str(REPO / "launch.py")))
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the CLI runs on the plain CPU device, as a user would
    args = [
        "train",
        "--config",
        str(REPO / "configs" / "tiny_alfworld.py"),
        f"--config.env.data_dir={alf_data}",
        *RUN,
        "--workdir",
        str(work),
    ]
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, str(driver), *args], capture_output=True, text=True, cwd=REPO, timeout=600, env=env
    )
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        raise AssertionError(f"launch.py {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    print(f"launch.py train on ALFWorld: {seconds:.0f} s")
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    calls = [json.loads(line) for line in tap_log.read_text().splitlines()]
    with np.load(work / "batches" / "iter_00001.npz") as z:
        batch = {k: z[k] for k in z.files}
    return {"work": work, "rows": rows, "calls": calls, "batch": batch, "seconds": seconds}


def train_call(e2e) -> dict:
    calls = [c for c in e2e["calls"] if c["judgment"]]
    assert len(calls) == 1 and (calls[0]["n"], calls[0]["m"], calls[0]["max_steps"]) == (N, M, H)
    return calls[0]


# --------------------------------------------------------------------------------------------
# 1. launch.py on real games


@pytest.mark.slow
def test_e2e_batch_shapes_and_no_lost_trajectory(e2e):
    b, row = e2e["batch"], e2e["rows"][-1]
    for k in ("step_mask", "env_reward", "invalid", "milestone", "judged_bad", "anchor_id", "action_id"):
        assert b[k].shape == (P, N, M, H), k
    for k in ("won", "episode_return"):
        assert b[k].shape == (P, N, M), k
    for k in ("strategy_mask", "strategy_len", "strategy_malformed"):
        assert b[k].shape == (P, N), k
    assert b["horizon"].shape == (P,)

    has_steps = b["step_mask"].any(-1)  # [P, N, M]
    stats = train_call(e2e)["stats"]
    assert row["train/num_trajectories"] == P * N * M
    # every one of the P*N*M trajectories is either in the batch or counted, none dropped silently
    assert has_steps.sum() + row["train/crashed"] + row["train/unrun"] == P * N * M
    assert stats["crashed"] == row["train/crashed"] and stats["in_batch"] == has_steps.sum()
    assert row["train/num_steps"] == b["step_mask"].sum()
    assert row["train/milestones"] == (b["milestone"] & b["step_mask"]).sum()
    assert row["train/invalid_rate"] == pytest.approx(b["invalid"].sum() / max(b["step_mask"].sum(), 1))
    assert row["train/success"] == pytest.approx(b["won"][has_steps].mean() if has_steps.any() else 0.0)

    # steps are a prefix; flags only on existing steps; judged steps in [1, episode length]
    lengths = b["step_mask"].sum(-1)
    assert (b["step_mask"] == (np.arange(H) < lengths[..., None])).all()
    for k in ("invalid", "milestone", "judged_bad"):
        assert not (b[k] & ~b["step_mask"]).any(), k
    assert not (b["milestone"] & b["invalid"]).any()  # an invalid output is the no-op
    assert (b["env_reward"] == 0).all()  # ALFWorld's own reward is unused: R = r_succ * won
    assert ((b["action_id"] >= 0) == (b["step_mask"] & ~b["invalid"])).all()
    assert ((b["anchor_id"] >= 0) == b["step_mask"]).all()
    assert (b["episode_return"] == 10.0 * b["won"]).all()

    # StraTA: each task keeps N of its sigma*N candidates; a strategy exists iff it has trajectories
    assert (b["strategy_mask"] == has_steps.any(-1)).all()
    assert row["train/strategy_malformed"] == (b["strategy_malformed"] & b["strategy_mask"]).sum()
    assert ((b["strategy_len"] >= 1) & (b["strategy_len"] <= 16))[b["strategy_mask"]].all()

    assert np.isfinite(row["update/loss"]) and row["update/steps"] >= 1
    assert np.isfinite(row["update/grad_norm"]) and row["update/skipped_total"] == 0


@pytest.mark.slow
def test_e2e_horizon_is_the_expert_plan_length(e2e, alf_data):
    b, call = e2e["batch"], train_call(e2e)
    games = list_split(alf_data, TRAIN_SPLIT)
    assert len(games) == 140  # shared/data/alfworld/README.md
    tasks = call["tasks"]
    assert len(tasks) == P and len(set(tasks)) == P and all(0 <= t < len(games) for t in tasks)
    want = [len(traj_data(alf_data, games[t])["high_level_plan"]) for t in tasks]
    assert b["horizon"].tolist() == want and all(h in (4, 6, 8) for h in want)


@pytest.mark.slow
def test_e2e_replay_matches_batch(e2e, alf_data):
    """Every logged command replayed in a fresh env: observations, ids, flags and milestones agree."""
    call = train_call(e2e)
    counts = replay(alf_data, TRAIN_SPLIT, call["tasks"], call["texts"]["trajectories"], e2e["batch"], H)
    assert counts["steps"] == e2e["batch"]["step_mask"].sum() and counts["crashed"] == e2e["rows"][-1]["train/crashed"]
    # a step judged bad is named (1-based) inside the judge's <bad_steps> answer of its trajectory
    for tr in call["texts"]["trajectories"]:
        flagged = np.flatnonzero(e2e["batch"]["judged_bad"][tuple(tr["key"])]) + 1
        named = {
            int(x)
            for x in re.findall(
                r"\d+", (re.findall(r"<bad_steps>(.*?)</bad_steps>", tr["judge"] or "", re.I | re.S) or [""])[0]
            )
        }
        assert set(flagged.tolist()) <= named, (tr["key"], tr["judge"])


@pytest.mark.slow
def test_e2e_metrics_rows_and_eval_split(e2e, alf_data):
    rows = e2e["rows"]
    assert [r["iteration"] for r in rows] == [0, 1]  # 0 = the starting model's evaluation
    for r in rows:
        assert r["eval/tasks"] == 2 and 0.0 <= r["eval/success"] <= 1.0
    evals = [c for c in e2e["calls"] if not c["judgment"]]
    assert len(evals) == 2 and all((c["n"], c["m"]) == (1, 1) for c in evals)
    assert len(list_split(alf_data, EVAL_SPLIT)) == 134
    for c in evals:  # the evaluation played valid_unseen games: its texts replay there
        assert len(c["tasks"]) == 2
        counts = replay(alf_data, EVAL_SPLIT, c["tasks"], c["texts"]["trajectories"], None, H)
        assert counts["steps"] >= 2 and counts["crashed"] == 0
    assert (e2e["work"] / "checkpoints").is_dir() and (e2e["work"] / "sft_model" / "config.json").exists()
    cfg = json.loads((e2e["work"] / "config.json").read_text())
    assert cfg["env"]["name"] == "alfworld" and cfg["algo"]["name"] == "strata" and cfg["model"]["path"] == ""


# --------------------------------------------------------------------------------------------
# 2. scripted trajectories through the same rollout loop: wins, milestones, invalid outputs, a crash

BOOK = "pick_and_place_simple-Book-None-SideTable-329"  # book on bed 1 -> a sidetable
LAMP = "look_at_obj_in_light-AlarmClock-None-DeskLamp-323"  # alarmclock on dresser 1, desklamp on desk 1
SCRIPTS = {  # (task p, strategy n, trajectory m) -> the model outputs, one per step
    (0, 0, 0): ["go to bed 1", "take book 1 from bed 1", "go to sidetable 1", "put book 1 in/on sidetable 1"],
    (0, 0, 1): [
        "go to bed 1",
        "<no action here>",
        "take book 2 from bed 1",
        "take book 1 from bed 1",
        "go to sidetable 2",
        "put book 2 in/on sidetable 2",
    ],
    (0, 1, 0): [
        "go to sidetable 1",
        "go to bed 1",
        "take book 2 from bed 1",
        "go to drawer 1",
        "open drawer 1",
        "look",
    ],
    (0, 1, 1): ["go to bed 1", "take moon 1 from sky 1", "take book 1 from bed 1", "CRASH"],
    (1, 0, 0): ["go to dresser 1", "take alarmclock 1 from dresser 1", "go to desk 1", "use desklamp 1"],
    (1, 0, 1): [
        "go to desk 1",
        "use desklamp 1",
        "go to dresser 1",
        "take alarmclock 1 from dresser 1",
        "go to desk 1",
        "use desklamp 1",
    ],
    (1, 1, 0): ["inventory", "", "go to dresser 1", "examine dresser 1", "take alarmclock 1 from dresser 1", "look"],
    (1, 1, 1): ["go to bed 1", "go to desk 1", "go to dresser 1", "go to desk 1", "go to dresser 1", "look"],
}


def test_scripted_rollout_on_real_games_replays(alf_data):
    from rollout.collect import RolloutConfig, collect
    from rollout.envs.alfworld import AlfWorldEnv
    from rollout.policy import ScriptedPolicy

    h = 6

    class CrashOnCue(AlfWorldEnv):  # an engine failure on one trajectory mid-episode
        def step(self, action):
            if action == "crash":
                raise RuntimeError("injected engine crash")
            return super().step(action)

    def script(messages, kind, key):
        if kind == "strategy":
            return f"<strategy>plan {key[1]}: find the object, take it, then finish the task</strategy>"
        if kind == "judge":
            return "<bad_steps>2</bad_steps>"
        out = SCRIPTS[key[:3]][key[3]]
        if out == "CRASH":  # admissible only as far as parsing goes: listed by the crashing env below
            return "<action>crash</action>"
        return out if out.startswith("<") else f"<think>step</think><action>{out}</action>"

    games = list_split(alf_data, TRAIN_SPLIT)
    tasks = [games.index(next(g for g in games if f"/{name}/" in g + "/")) for name in (BOOK, LAMP)]
    crash_e = ((0 * N) + 1) * M + 1  # (p, n, m) = (0, 1, 1)
    envs = [
        CrashOnCue(alf_data, split=TRAIN_SPLIT, max_steps=h)
        if e == crash_e
        else AlfWorldEnv(alf_data, split=TRAIN_SPLIT, max_steps=h)
        for e in range(P * N * M)
    ]
    orig_step = envs[crash_e].step

    def step_listing_crash(action):  # make "crash" parse as admissible for this env only
        out = orig_step(action)
        out[4]["admissible_commands"] = [*out[4]["admissible_commands"], "crash"]
        return out

    envs[crash_e].step = step_listing_crash
    cfg = RolloutConfig(
        mode="strata",
        num_strategies=N,
        traj_per_strategy=M,
        oversample=2,
        diverse=True,
        judgment=True,
        max_steps=h,
        length_buckets=None,
        row_multiple=8,
        progress=False,
    )
    res = collect(envs, ScriptedPolicy(script), tasks, cfg)
    b = {
        f: np.asarray(getattr(res.traj, f))
        for f in (
            "step_mask",
            "won",
            "episode_return",
            "invalid",
            "milestone",
            "judged_bad",
            "anchor_id",
            "action_id",
            "strategy_mask",
            "horizon",
        )
    }
    assert b["step_mask"].shape == (P, N, M, h)
    assert b["horizon"].tolist() == [len(traj_data(alf_data, games[t])["high_level_plan"]) for t in tasks] == [4, 4]

    counts = replay(alf_data, TRAIN_SPLIT, tasks, res.texts["trajectories"], b, h)
    # the checks above were not vacuous: real wins, milestones, invalid outputs and one crash
    assert counts["crashed"] == res.stats["crashed"] == 1 and not b["step_mask"][0, 1, 1].any()
    assert counts["wins"] >= 3 and counts["milestones"] >= 8 and counts["invalid"] >= 3
    assert b["won"][0, 0, 0] and b["step_mask"][0, 0, 0].sum() == 4  # won at step 4 < H: episode ends there
    assert b["milestone"][0, 0, 0].tolist() == [False, True, False, True, False, False]
    assert b["milestone"][1, 0, 1].tolist()[:2] == [False, True]  # the lamp on before holding: a goal fact
    # every trajectory is in the batch or counted as crashed; a crash keeps its strategy if a sibling ran
    assert b["step_mask"].any(-1).sum() + res.stats["crashed"] + res.stats["unrun"] == P * N * M
    assert b["strategy_mask"].all()
    # self-judgment "2" marks step 2 of every judged trajectory, nothing outside the episode
    assert (b["judged_bad"] == (b["step_mask"] & (np.arange(h) == 1))).all()
