"""Household world: dynamics against hand-written expectations, the expert, horizons, milestones."""

import collections
import copy

import pytest

from rollout.envs.base import EnvError
from rollout.envs.household import HouseholdEnv, expert_plan, solve
from rollout.envs.household_world import TASK_TYPES, Task, World

# Goal facts per task type, written out from the task definitions (section 4 of ALGORITHMS.md).
MILESTONES = {
    "pick_and_place": 2,  # picked, placed
    "pick_two": 4,  # picked 1st, placed 1st, picked 2nd, placed 2nd
    "look_at_obj_in_light": 2,  # picked, looked at under the lit lamp
    "pick_clean_then_place": 3,  # picked, cleaned, placed
    "pick_heat_then_place": 3,
    "pick_cool_then_place": 3,
}


def run(env, actions):
    out = []
    for a in actions:
        out.append(env.step(a))
    return out


def test_expert_wins_every_task_at_its_horizon():
    env = HouseholdEnv(max_steps=30)
    seen = collections.Counter()
    for seed in range(400):
        _, info = env.reset(seed=seed)
        plan = expert_plan(env)
        assert len(plan) == info["horizon"]
        assert info["milestones_total"] == MILESTONES[info["task_type"]]
        milestones = 0
        for i, action in enumerate(plan):
            assert action in info["admissible_commands"], (seed, action)
            _, reward, term, trunc, info = env.step(action)
            assert reward == 0.0 and not trunc
            assert term == info["won"] == (i == len(plan) - 1), (seed, plan, i)
            milestones += info["milestone"]
        assert milestones == MILESTONES[env.task.task_type], (seed, plan)
        seen[len(plan)] += 1
        seen[env.task.task_type] += 1
    assert {L for L in seen if isinstance(L, int)} == set(range(2, 13))
    assert all(seen[t] > 20 for t in TASK_TYPES)


@pytest.mark.parametrize("lo,hi", [(2, 2), (4, 6), (12, 12), (9, 12)])
def test_horizon_range_controls_plan_length(lo, hi):
    env = HouseholdEnv(horizon=(lo, hi))
    lengths = set()
    for seed in range(60):
        _, info = env.reset(seed=seed)
        assert lo <= info["horizon"] <= hi
        lengths.add(info["horizon"])
    assert lengths == set(range(lo, hi + 1))


def test_same_seed_same_task_and_solve():
    a, b = HouseholdEnv(), HouseholdEnv()
    oa, ia = a.reset(seed=17)
    a.step("look")
    ob, ib = b.reset(seed=17)
    assert oa == ob and ia == ib
    oa2, ia2 = a.reset(seed=17)  # resetting after steps restores the same start
    assert oa2 == oa and ia2 == ia
    assert solve(17) == expert_plan(a)
    tasks = {HouseholdEnv().reset(seed=s)[0] for s in range(30)}
    assert len(tasks) == 30


def test_noop_consumes_a_step_and_changes_nothing():
    env = HouseholdEnv(max_steps=3)
    _, info0 = env.reset(seed=3)
    state = copy.deepcopy(env.world)
    obs, reward, term, trunc, info = env.step("")
    assert obs == "Nothing happens." and reward == 0.0 and not term and not trunc
    assert env.world == state and info["admissible_commands"] == info0["admissible_commands"]
    assert not info["milestone"] and info["milestone_name"] is None
    env.step("")
    *_, term, trunc, _ = env.step("")
    assert trunc and not term
    with pytest.raises(EnvError, match="after the episode ended"):
        env.step("look")


def kitchen() -> tuple[Task, World]:
    """A hand-built world: apple in a closed cabinet, target countertop, microwave, a lamp."""
    rtype = {"cabinet 1": "cabinet", "countertop 1": "countertop", "microwave 1": "microwave", "desk 1": "desk"}
    world = World(
        rtype=rtype,
        loc={"cabinet 1": 3, "countertop 1": 7, "microwave 1": 1, "desk 1": 9},
        openable={"cabinet 1", "microwave 1"},
        opened=set(),
        contents={"cabinet 1": ["apple 1"], "countertop 1": ["mug 1"], "microwave 1": [], "desk 1": []},
        where={"apple 1": "cabinet 1", "mug 1": "countertop 1"},
        at=None,
        held=None,
        lamp_host="desk 1",
    )
    task = Task("pick_heat_then_place", "apple", "countertop", 1, "put a hot apple in countertop.", {})
    return task, world


def test_dynamics_and_wording_by_hand():
    env = HouseholdEnv()
    obs, info = env.start(*kitchen())
    assert obs.endswith("Your task is to: put a hot apple in countertop.")
    assert "You are in the middle of a room." in obs
    assert info["horizon"] == 7 and info["milestones_total"] == 3
    assert expert_plan(env) == [
        "go to cabinet 1",
        "open cabinet 1",
        "take apple 1 from cabinet 1",
        "go to microwave 1",
        "heat apple 1 with microwave 1",
        "go to countertop 1",
        "put apple 1 in/on countertop 1",
    ]
    script = [
        ("take apple 1 from cabinet 1", "Nothing happens.", None),  # not there yet
        ("go to cabinet 1", "You arrive at loc 3. The cabinet 1 is closed.", None),
        ("take apple 1 from cabinet 1", "Nothing happens.", None),  # closed
        ("open cabinet 1", "You open the cabinet 1. The cabinet 1 is open. In it, you see a apple 1.", None),
        ("inventory", "You are not carrying anything.", None),
        ("take apple 1 from cabinet 1", "You pick up the apple 1 from the cabinet 1.", "picked apple 1"),
        ("go to countertop 1", "You arrive at loc 7. On the countertop 1, you see a mug 1.", None),
        ("take mug 1 from countertop 1", "Nothing happens.", None),  # hands full
        ("put apple 1 in/on countertop 1", "You put the apple 1 in/on the countertop 1.", None),  # not hot
        ("take apple 1 from countertop 1", "You pick up the apple 1 from the countertop 1.", None),  # not new
        ("heat apple 1 with microwave 1", "Nothing happens.", None),  # not at the microwave
        ("go to microwave 1", "You arrive at loc 1. The microwave 1 is closed.", None),
        ("heat apple 1 with microwave 1", "You heat the apple 1 using the microwave 1.", "heated apple 1"),
        ("heat apple 1 with microwave 1", "You heat the apple 1 using the microwave 1.", None),
        ("go to desk 1", "You arrive at loc 9. On the desk 1, you see a desklamp 1.", None),
        ("use desklamp 1", "You turn on the desklamp 1.", None),
        ("go to countertop 1", "You arrive at loc 7. On the countertop 1, you see a mug 1.", None),
        ("put apple 1 in countertop 1", "You put the apple 1 in/on the countertop 1.", "placed 1 apple in countertop"),
    ]
    for i, (action, want_obs, want_ms) in enumerate(script):
        obs, _, term, _, info = env.step(action)
        assert obs == want_obs, action
        assert info["milestone_name"] == want_ms and info["milestone"] == (want_ms is not None)
        assert term == info["won"] == (i == len(script) - 1)


def test_admissible_commands_by_hand():
    env = HouseholdEnv()
    env.start(*kitchen())
    assert env.admissible_commands() == sorted(
        ["go to cabinet 1", "go to countertop 1", "go to desk 1", "go to microwave 1", "inventory", "look"]
    )
    run(env, ["go to cabinet 1", "open cabinet 1", "take apple 1 from cabinet 1", "go to microwave 1"])
    assert env.admissible_commands() == sorted(
        [
            "go to cabinet 1",
            "go to countertop 1",
            "go to desk 1",
            "examine apple 1",
            "examine microwave 1",
            "heat apple 1 with microwave 1",
            "inventory",
            "look",
            "open microwave 1",
        ]
    )


def test_look_task_lamp_already_on():
    """Holding the object where the lamp is already lit wins on the take: both facts at once."""
    rtype = {"desk 1": "desk", "shelf 1": "shelf"}
    world = World(
        rtype=rtype,
        loc={"desk 1": 2, "shelf 1": 5},
        openable=set(),
        opened=set(),
        contents={"desk 1": ["book 1"], "shelf 1": []},
        where={"book 1": "desk 1"},
        at="desk 1",
        held=None,
        lamp_host="desk 1",
    )
    env = HouseholdEnv()
    _, info = env.start(Task("look_at_obj_in_light", "book", None, 1, "look at book under the desklamp.", {}), world)
    assert expert_plan(env) == ["take book 1 from desk 1", "use desklamp 1"]
    assert env.step("use desklamp 1")[0] == "You turn on the desklamp 1."
    obs, _, term, _, info = env.step("take book 1 from desk 1")
    assert term and info["milestone_name"] == "picked book 1; looked at book 1 under the desklamp"


def bfs_length(env, limit):
    """Shortest winning command sequence by breadth-first search over the env's own dynamics."""
    start = copy.deepcopy((env.world, env._picked, env._placed, env._lit, env._transformed))
    frontier, seen = [start], set()
    for depth in range(1, limit + 1):
        nxt = []
        for snap in frontier:
            env.world, env._picked, env._placed, env._lit, env._transformed = copy.deepcopy(snap)
            env.done = env.won = False
            for a in env.admissible_commands():
                if a.startswith(("look", "inventory", "examine")):
                    continue
                env.world, env._picked, env._placed, env._lit, env._transformed = copy.deepcopy(snap)
                env.done = env.won = False
                env.steps = 0
                *_, info = env.step(a)
                if info["won"]:
                    return depth
                w = env.world
                key = (
                    w.at,
                    w.held,
                    tuple(sorted(w.opened)),
                    tuple(sorted(w.where.items(), key=str)),
                    tuple(tuple(sorted(w.state[v])) for v in ("heat", "cool", "clean")),
                    w.lamp_on,
                )
                if key not in seen:
                    seen.add(key)
                    nxt.append(copy.deepcopy((env.world, env._picked, env._placed, env._lit, env._transformed)))
        frontier = nxt
    return None


def test_expert_plan_is_shortest_on_small_worlds():
    env = HouseholdEnv(horizon=(2, 8), n_extra_receptacles=0, n_distractors=1, max_steps=100)
    for seed in range(10):
        _, info = env.reset(seed=seed)
        assert bfs_length(env, info["horizon"]) == info["horizon"], (seed, expert_plan(env))


def test_bad_configuration_and_input():
    with pytest.raises(ValueError, match="unknown task_types.*pick_and_place"):
        HouseholdEnv(task_types=("make_coffee",))
    with pytest.raises(ValueError, match="horizon"):
        HouseholdEnv(horizon=(5, 3))
    with pytest.raises(ValueError, match="no task type"):
        HouseholdEnv(horizon=(2, 2), task_types=("pick_two",))
    env = HouseholdEnv()
    with pytest.raises(EnvError, match="before reset"):
        env.step("look")
    env.reset(seed=0)
    with pytest.raises(TypeError, match="str"):
        env.step(None)
    with pytest.raises(ValueError, match="max_steps"):
        HouseholdEnv(max_steps=0)
