"""Real ALFWorld games (eval.tar.xz): contract, hand-written wins, milestones, stock-engine parity."""

import json
import random
import subprocess
import sys

import pytest

from rollout.envs.alfworld import AlfWorldEnv, list_games, normalise_action
from rollout.envs.base import EnvError

BOOK = "pick_and_place_simple-Book-None-SideTable-329"  # book on bed 1 -> sidetable
APPLE = "pick_heat_then_place_in_recep-Apple-None-DiningTable-26"  # apple on diningtable 2
LAMP = "look_at_obj_in_light-AlarmClock-None-DeskLamp-323"  # alarmclock on dresser 1


@pytest.fixture(scope="module")
def seen(alf_data):
    return AlfWorldEnv(alf_data, split="valid_seen")


def seed_of(env, name):
    hits = [i for i, g in enumerate(env.games) if f"/{name}/" in g + "/"]
    assert len(hits) == 1, name
    return hits[0]


def play(env, actions):
    return [env.step(a) for a in actions]


def test_missing_data_and_bad_arguments(tmp_path, alf_data):
    with pytest.raises(EnvError, match=r"tar xJf .*eval\.tar\.xz"):
        AlfWorldEnv(tmp_path, split="valid_seen")
    with pytest.raises(EnvError, match=r"train\.tar\.xz"):
        AlfWorldEnv(alf_data, split="train")
    with pytest.raises(ValueError, match="valid_unseen"):
        AlfWorldEnv(alf_data, split="test")
    with pytest.raises(ValueError, match="expert_plan"):
        AlfWorldEnv(alf_data, split="valid_seen", milestones="text")
    env = AlfWorldEnv(alf_data, split="valid_seen")
    with pytest.raises(EnvError, match="before reset"):
        env.step("look")


def test_splits_are_the_published_ones(alf_data):
    seen, unseen = list_games(alf_data, "valid_seen"), list_games(alf_data, "valid_unseen")
    assert (len(seen), len(unseen)) == (140, 134)  # README of shared/data/alfworld
    assert seen == sorted(seen) and all(g.startswith("valid_seen/") for g in seen)
    only = AlfWorldEnv(alf_data, split="valid_unseen", task_types=("pick_two_obj_and_place",))
    assert 0 < only.num_tasks < 134 and all("pick_two_obj_and_place-" in g for g in only.games)


def test_hand_written_win_with_fact_milestones(seen):
    s = seed_of(seen, BOOK)
    obs, info = seen.reset(seed=s + 2 * seen.num_tasks)  # seeds wrap around the split
    assert info["task_id"].startswith(f"valid_seen/{BOOK}/")
    assert info["task"] == "put some book on sidetable."
    assert info["task_type"] == "pick_and_place_simple"
    assert info["horizon"] == 4 and info["milestones_total"] == 2 and info["won"] is False
    assert "go to bed 1" in info["admissible_commands"]
    script = [  # (command, observation, milestone) read off the game by hand
        (
            "go to bed 1",
            "You arrive at loc 8. On the bed 1, you see a book 2, a book 1, a cellphone 2, and a pillow 1.",
            None,
        ),
        ("take book 1 from bed 1", "You pick up the book 1 from the bed 1.", "holds book 1"),
        ("take book 2 from bed 1", "Nothing happens.", None),  # hands full
        ("", "Nothing happens.", None),
        ("go to sidetable 2", "You arrive at loc 2. On the sidetable 2, you see nothing.", None),
        ("go to sidetable 1", "You arrive at loc 10. On the sidetable 1, you see nothing.", None),
        ("put book 1 in/on sidetable 1", "You put the book 1 in/on the sidetable 1.", "1 book in sidetable"),
    ]
    for i, (action, want, milestone) in enumerate(script):
        obs, reward, term, trunc, info = seen.step(action)
        assert (obs, info["milestone_name"]) == (want, milestone), action
        assert info["milestone"] == (milestone is not None) and reward == 0.0 and not trunc
        assert term == info["won"] == (i == len(script) - 1)
    with pytest.raises(EnvError, match="after the episode ended"):
        seen.step("look")


def test_heat_task_fact_milestones(seen):
    _, info = seen.reset(seed=seed_of(seen, APPLE))
    assert info["task"] == "heat some apple and put it in diningtable."
    assert info["horizon"] == 6 and info["milestones_total"] == 3
    script = [
        ("go to diningtable 2", None),
        ("take apple 1 from diningtable 2", "holds apple 1"),
        ("go to diningtable 1", None),
        ("put apple 1 in/on diningtable 1", None),  # not hot yet: not the goal fact
        ("take apple 1 from diningtable 1", None),  # held before
        ("go to microwave 1", None),
        ("heat apple 1 with microwave 1", "ishot apple 1"),
        ("heat apple 1 with microwave 1", None),
        ("go to diningtable 1", None),
        ("put apple 1 in/on diningtable 1", "1 apple in diningtable"),
    ]
    for action, milestone in script:
        obs, _, term, _, info = seen.step(action)
        assert info["milestone_name"] == milestone, (action, obs)
    assert term and info["won"]


def test_lamp_task_fact_milestones(seen):
    _, info = seen.reset(seed=seed_of(seen, LAMP))
    assert info["milestones_total"] == 2
    got = [
        i["milestone_name"]
        for *_, i in play(
            seen, ["go to dresser 1", "take alarmclock 1 from dresser 1", "go to desk 1", "use desklamp 1"]
        )
    ]
    assert got == [None, "holds alarmclock 1", None, "istoggled desklamp 1"]
    assert seen.won


def test_expert_plan_milestones_exact_in_order(alf_data):
    env = AlfWorldEnv(alf_data, split="valid_seen", milestones="expert_plan")
    _, info = env.reset(seed=seed_of(env, BOOK))
    assert info["milestones_total"] == 4  # GotoLocation bed, Pickup book, Goto sidetable, Put
    actions = [
        "go to sidetable 1",
        "go to bed 1",
        "take book 2 from bed 1",
        "go to drawer 1",
        "open drawer 1",
        "go to sidetable 2",
        "put book 2 in/on sidetable 2",
    ]
    got = [i["milestone_name"] for *_, i in play(env, actions)]
    assert got == [
        None,  # out of order: the plan starts at the bed
        "plan step 1: GotoLocation bed",
        "plan step 2: PickupObject book",
        None,
        None,
        "plan step 3: GotoLocation sidetable",
        "plan step 4: PutObject book sidetable",
    ]
    _, info = env.reset(seed=seed_of(env, LAMP))  # "GotoLocation desklamp": where a desklamp is
    got = [
        i["milestone_name"]
        for *_, i in play(
            env,
            ["go to dresser 1", "take alarmclock 1 from dresser 1", "go to bed 1", "go to desk 1", "use desklamp 1"],
        )
    ]
    assert got == [
        "plan step 1: GotoLocation dresser",
        "plan step 2: PickupObject alarmclock",
        None,
        "plan step 3: GotoLocation desklamp",
        "plan step 4: ToggleObject desklamp",
    ]


def test_normalise_action():
    assert normalise_action("put apple 1 in/on diningtable 2") == ("PutObject", ("apple", "diningtable"))
    assert normalise_action("take apple 1 from diningtable 2") == ("PickupObject", ("apple",))
    assert normalise_action("open fridge 1") is None and normalise_action("look") is None


def test_unseen_games_reset_and_step(alf_data):
    env = AlfWorldEnv(alf_data, split="valid_unseen", max_steps=3)
    rng = random.Random(0)
    for seed in (0, 50, 133):
        obs, info = env.reset(seed=seed)
        assert obs.startswith("-= Welcome to TextWorld, ALFRED! =-")
        assert set(info) >= {
            "task",
            "admissible_commands",
            "task_type",
            "horizon",
            "task_id",
            "won",
            "milestones_total",
        }
        traj = json.loads((alf_data / "json_2.1.1" / info["task_id"] / "traj_data.json").read_text())
        assert info["horizon"] == len(traj["high_level_plan"]) and info["horizon"] in (4, 6, 8)
        assert info["task_type"] == traj["task_type"] and info["milestones_total"] >= 2
        for t in range(3):
            a = rng.choice(info["admissible_commands"])
            obs, _, term, trunc, info = env.step(a)
            assert obs != "Nothing happens.", a  # admissible commands act
            assert trunc == (t == 2 and not term)


STOCK = r"""
import json, sys, textworld
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
out = []
for game, actions in json.loads(sys.stdin.read()):
    infos = textworld.EnvInfos(won=True, admissible_commands=True)
    env = textworld.start(game, request_infos=infos, wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])
    s = env.reset()
    rows = [[s.feedback, s.admissible_commands, s.won]]
    for a in actions:
        s, _, _ = env.step(a)
        rows.append([s.feedback, s.admissible_commands, s.won])
    out.append(rows)
print(json.dumps(out))
"""


def test_same_text_as_stock_textworld(alf_data):
    """Our cached/memoised engine gives exactly stock TextWorld's observations and commands."""
    env = AlfWorldEnv(alf_data, split="valid_seen", max_steps=100)
    rng = random.Random(1)
    jobs, ours = [], []
    for name in (APPLE, LAMP):
        obs, info = env.reset(seed=seed_of(env, name))
        rows, actions = [[obs, info["admissible_commands"], False]], []
        for _ in range(10):  # a random walk over admissible commands, with an invalid one
            a = rng.choice(info["admissible_commands"] + ["take moon 1 from sky 1"])
            obs, _, _, _, info = env.step(a)
            actions.append(a)
            rows.append([obs, info["admissible_commands"], info["won"]])
        jobs.append([info_gamefile(alf_data, env), actions])
        ours.append(rows)
    proc = subprocess.run(
        [sys.executable, "-c", STOCK], input=json.dumps(jobs), text=True, capture_output=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ours


def info_gamefile(alf_data, env):
    return str(alf_data / "json_2.1.1" / env._loaded / "game.tw-pddl")


def test_disk_cache_of_translations(alf_data, tmp_path, monkeypatch):
    from rollout.envs import alfworld

    first = AlfWorldEnv(alf_data, split="valid_unseen", cache_dir=tmp_path)
    want = first.reset(seed=7)
    assert len(list(tmp_path.glob("*.pkl.z"))) == 1
    alfworld._GAME_CACHE.data.clear()  # force a load: it must come from disk, not the translator
    monkeypatch.setattr(alfworld, "_pddl2sas", lambda *a: pytest.fail("translated again"))
    second = AlfWorldEnv(alf_data, split="valid_unseen", cache_dir=tmp_path)
    assert second.reset(seed=7) == want
    assert second.step("look") == first.step("look")
