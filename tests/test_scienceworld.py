"""ScienceWorld on its real simulator (JVM). Slow-ish (seconds per reset); a JVM failure fails."""

import pytest

from rollout.envs.base import EnvError
from rollout.envs.scienceworld import NOTHING, ScienceWorldEnv

TASK = "find-living-thing"


@pytest.fixture(scope="module")
def env():
    e = ScienceWorldEnv(max_steps=8, task_names=(TASK,))
    yield e
    e.close()


@pytest.mark.slow
def test_reset_step_milestones_and_win(env):
    obs, info = env.reset(seed=0)
    goal = (
        "Your task is to find a(n) living thing. First, focus on the thing. "
        "Then, move it to the red box in the kitchen."
    )
    assert info["task"] == goal and obs.startswith(goal) and "This room is called the hallway." in obs
    assert info["task_type"] == TASK and info["task_id"] == f"{TASK}/train/0"
    assert info["milestones_total"] == -1 and info["horizon"] == -1 and not info["won"]
    assert "teleport to outside" in info["admissible_commands"]
    start = info["score"]

    obs, reward, term, trunc, info = env.step("")  # the no-op never reaches the simulator
    assert (obs, reward, term, trunc, info["milestone"]) == (NOTHING, 0.0, False, False, False)

    script = [  # written by hand from the task text: the world outside has a dove egg
        ("teleport to outside", "You teleport to the outside."),
        ("look around", None),
        ("focus on dove egg", "You focus on the dove egg."),
        ("pick up dove egg", "You move the dove to the inventory."),
        ("teleport to kitchen", "You teleport to the kitchen."),
        ("move dove to red box", "You move the dove to the red box."),
    ]
    scores, milestones = [start], []
    for action, want in script:
        obs, reward, term, trunc, info = env.step(action)
        if want is not None:
            assert obs == want, action
        assert info["milestone"] == (info["score"] > max(scores))
        scores.append(info["score"])
        milestones.append(info["milestone"])
    assert milestones[0] and not milestones[1]  # teleporting outside scores, looking does not
    assert term and info["won"] and info["score"] == 100 and not trunc and not info["lost"]
    with pytest.raises(EnvError, match="after the episode ended"):
        env.step("look around")


@pytest.mark.slow
def test_same_seed_same_world_and_failure_ends_episode(env):
    obs_a, info_a = env.reset(seed=0)
    env.step("teleport to outside")
    look_a = env.step("look around")[0]
    obs_b, info_b = env.reset(seed=0)
    env.step("teleport to outside")
    assert (obs_a, info_a) == (obs_b, info_b) and env.step("look around")[0] == look_a
    assert "a dove egg" in look_a
    obs, _, term, trunc, info = env.step("focus on axe")  # not a living thing: task failed
    assert term and info["lost"] and not info["won"] and info["score"] < 0 and not trunc


def test_bad_arguments():
    with pytest.raises(ValueError, match="train, dev, test"):
        ScienceWorldEnv(split="validation")
    with pytest.raises(EnvError, match="before reset"):
        ScienceWorldEnv().step("look around")
