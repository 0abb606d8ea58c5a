"""The household's expert: the shortest plan of a generated task from its initial state, built
from the generator's structure (rollout/envs/household_world.py says why it is shortest).
"""

from __future__ import annotations

from rollout.envs.household_world import TRANSFORMS, Task, World, otype


def shortest_plan(task: Task, w: World) -> list[str]:
    """Shortest plan from the initial state, built from the generator's structure."""
    plan: list[str] = []
    at, opened, held = w.at, set(w.opened), w.held
    targets = sorted(o for o in w.where if otype(o) == task.obj_type)[: task.need]

    def goto(r: str) -> None:
        nonlocal at
        if at != r:
            plan.append(f"go to {r}")
            at = r

    def open_(r: str) -> None:
        if r in w.openable and r not in opened:
            plan.append(f"open {r}")
            opened.add(r)

    target = None
    if task.target_type is not None:
        target = min(r for r, t in w.rtype.items() if t == task.target_type)
    for o in targets:
        src = w.where[o]
        goto(src)
        open_(src)
        if held is not None:  # hands full: put the unrelated object down here
            plan.append(f"put {held} in/on {src}")
            held = None
        plan.append(f"take {o} from {src}")
        if task.task_type == "look_at_obj_in_light":
            goto(w.lamp_host)
            plan.append("use desklamp 1")
            continue
        if task.task_type in TRANSFORMS:
            verb, app = TRANSFORMS[task.task_type]
            goto(f"{app} 1")
            plan.append(f"{verb} {o} with {app} 1")
        goto(target)
        open_(target)
        plan.append(f"put {o} in/on {target}")
    return plan
