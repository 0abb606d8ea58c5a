"""The household's tasks and worlds: ALFWorld's task types, receptacle and object types and goal
templates, and the generator that draws a (Task, World) from a seed with a controlled shortest-plan
length L*.

Horizon control. A task is drawn from its seed as (task type, feature switches); each switch adds
exactly one necessary command to the shortest plan:
    start_away   the agent starts in the middle of the room, not at the object's receptacle
    src_closed   the (first) object is inside a closed receptacle
    carrying     the agent starts holding an unrelated object it must put down first
    tgt_closed   the target receptacle type is openable (all instances start closed)
    lamp_away    (look_at_obj_in_light) the desklamp is not where the object is
    second       (pick_two) where the second object is: with the first / open / closed receptacle
Only the task's objects have the target type, and none starts in a target-type receptacle or in
the task's appliance, so the constructive plan of `household_expert.shortest_plan` is a shortest
plan and L* = len(plan) = `_plan_length` spans 2 (look: take, use) to 12 (pick_two with every
switch on).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

TASK_TYPES = (
    "pick_and_place",
    "pick_two",
    "look_at_obj_in_light",
    "pick_clean_then_place",
    "pick_heat_then_place",
    "pick_cool_then_place",
)
# Task type -> (transform verb, appliance receptacle type).
TRANSFORMS = {
    "pick_clean_then_place": ("clean", "sinkbasin"),
    "pick_heat_then_place": ("heat", "microwave"),
    "pick_cool_then_place": ("cool", "fridge"),
}
APPLIANCES = ("sinkbasin", "microwave", "fridge")
OPENABLE = ("cabinet", "drawer", "safe")  # plus fridge / microwave (appliances)
SURFACES = (
    "countertop",
    "shelf",
    "diningtable",
    "coffeetable",
    "dresser",
    "sofa",
    "armchair",
    "garbagecan",
    "stoveburner",
    "bed",
)
LAMP_HOSTS = ("desk", "sidetable")
# Object types per task type (ALFWorld's own pairings, abridged).
OBJECTS = {
    "pick_and_place": (
        "apple",
        "book",
        "cellphone",
        "keychain",
        "pen",
        "pencil",
        "creditcard",
        "vase",
        "statue",
        "remotecontrol",
        "soapbottle",
        "spraybottle",
        "cd",
    ),
    "pick_two": (
        "book",
        "cellphone",
        "keychain",
        "pen",
        "pencil",
        "creditcard",
        "cd",
        "remotecontrol",
        "soapbar",
        "candle",
        "pillow",
    ),
    "look_at_obj_in_light": (
        "book",
        "cellphone",
        "alarmclock",
        "pen",
        "pencil",
        "keychain",
        "creditcard",
        "cd",
        "bowl",
        "mug",
        "statue",
    ),
    "pick_clean_then_place": (
        "apple",
        "mug",
        "plate",
        "cup",
        "bowl",
        "fork",
        "spoon",
        "spatula",
        "ladle",
        "pan",
        "pot",
        "soapbar",
        "cloth",
        "lettuce",
        "tomato",
    ),
    "pick_heat_then_place": ("apple", "bread", "potato", "tomato", "egg", "mug", "cup", "plate"),
    "pick_cool_then_place": (
        "apple",
        "bread",
        "potato",
        "tomato",
        "egg",
        "mug",
        "cup",
        "plate",
        "lettuce",
        "winebottle",
        "pan",
        "pot",
    ),
}
ALL_OBJECTS = tuple(sorted({o for v in OBJECTS.values() for o in v}))
# ALFWorld goal templates per task type.
TEMPLATES = {
    "pick_and_place": ("put a {o} in {r}.", "put some {o} on {r}."),
    "pick_two": ("put two {o} in {r}.", "find two {o} and put them in {r}."),
    "look_at_obj_in_light": ("look at {o} under the desklamp.", "examine the {o} with the desklamp."),
    "pick_clean_then_place": ("put a clean {o} in {r}.", "clean some {o} and put it in {r}."),
    "pick_heat_then_place": ("put a hot {o} in {r}.", "heat some {o} and put it in {r}."),
    "pick_cool_then_place": ("put a cool {o} in {r}.", "cool some {o} and put it in {r}."),
}


def _feature_space(task_type: str) -> list[dict[str, Any]]:
    """Every feature combination of a task type, with its exact shortest-plan length."""
    names = ["start_away", "src_closed", "carrying"]
    if task_type == "look_at_obj_in_light":
        names.append("lamp_away")
    else:
        names.append("tgt_closed")
    rows = []
    seconds = ("same", "open", "closed") if task_type == "pick_two" else (None,)
    for bits in itertools.product((False, True), repeat=len(names)):
        f = dict(zip(names, bits))
        if task_type == "look_at_obj_in_light" and not f["lamp_away"] and f["src_closed"]:
            continue  # the lamp stands on a desk / sidetable, which is never closed
        for second in seconds:
            f2 = dict(f, second=second)
            f2["length"] = _plan_length(task_type, f2)
            rows.append(f2)
    return rows


def _plan_length(task_type: str, f: dict[str, Any]) -> int:
    n = int(f["start_away"]) + int(f["src_closed"]) + int(f["carrying"]) + 1  # reach + take
    if task_type == "look_at_obj_in_light":
        return n + int(f["lamp_away"]) + 1  # go to lamp, use
    if task_type in TRANSFORMS:
        n += 2  # go to appliance, transform
    n += 1 + int(f["tgt_closed"]) + 1  # go to target, open it, put
    if task_type == "pick_two":
        n += 1 + int(f["second"] == "closed") + 1 + 1 + 1  # go, open, take, go, put
    return n


FEATURES = {t: _feature_space(t) for t in TASK_TYPES}


@dataclass
class Task:
    task_type: str
    obj_type: str
    target_type: str | None  # receptacle type (None for look_at_obj_in_light)
    need: int  # objects to place (2 for pick_two)
    goal: str
    features: dict[str, Any]


@dataclass
class World:
    """Mutable state of one episode; steps mutate it in place (no copies)."""

    rtype: dict[str, str]  # receptacle -> type
    loc: dict[str, int]  # receptacle -> "loc N"
    openable: set[str]
    opened: set[str]
    contents: dict[str, list[str]]  # receptacle -> objects, in placement order
    where: dict[str, str | None]  # object -> receptacle (None = held)
    at: str | None  # receptacle the agent stands at (None = middle of the room)
    held: str | None
    lamp_host: str | None
    lamp_on: bool = False
    state: dict[str, set[str]] = field(default_factory=lambda: {"heat": set(), "cool": set(), "clean": set()})


def otype(name: str) -> str:
    """An object's or receptacle's type: 'apple 2' -> 'apple'."""
    return name.rsplit(" ", 1)[0]


# ----------------------------------------------------------------------------- generation


def sample_task(rng: random.Random, lo: int, hi: int, types: tuple[str, ...]):
    """L* uniform over the reachable lengths in [lo, hi], then type, then features, uniform."""
    rows = [(t, f) for t in types for f in FEATURES[t] if lo <= f["length"] <= hi]
    if not rows:
        raise ValueError(f"no task type among {types} has a plan length in [{lo}, {hi}]")
    length = rng.choice(sorted({f["length"] for _, f in rows}))
    task_type = rng.choice(sorted({t for t, f in rows if f["length"] == length}))
    feats = rng.choice([f for t, f in rows if t == task_type and f["length"] == length])
    return task_type, dict(feats)


def reachable_types(lo: int, hi: int, types: tuple[str, ...] = TASK_TYPES) -> tuple[str, ...]:
    """The task types with at least one shortest-plan length in [lo, hi], in TASK_TYPES order."""
    return tuple(t for t in types if any(lo <= f["length"] <= hi for f in FEATURES[t]))


def task_type_of(seed: int, lo: int, hi: int, types: tuple[str, ...] = TASK_TYPES) -> str:
    """The task type `generate(seed, lo, hi, types, ...)` draws, without building the world."""
    return sample_task(random.Random(f"household-{seed}"), lo, hi, types)[0]


def generate(
    seed: int, lo: int, hi: int, types: tuple[str, ...], n_extra: int, n_distractors: int
) -> tuple[Task, World]:
    rng = random.Random(f"household-{seed}")
    task_type, f = sample_task(rng, lo, hi, types)
    obj_type = rng.choice(OBJECTS[task_type])
    appliance = TRANSFORMS.get(task_type, (None, None))[1]

    counts: dict[str, int] = {}
    rtype: dict[str, str] = {}

    def add(t: str) -> str:
        counts[t] = counts.get(t, 0) + 1
        name = f"{t} {counts[t]}"
        rtype[name] = t
        return name

    for t in APPLIANCES:  # every house has a kitchen corner
        add(t)
    # Target receptacle type: openable iff tgt_closed; never the task's appliance.
    target_type = None
    if task_type != "look_at_obj_in_light":
        pool = OPENABLE if f["tgt_closed"] else SURFACES
        if f["tgt_closed"] and task_type in ("pick_clean_then_place", "pick_heat_then_place"):
            pool = pool + ("fridge",)  # "put a hot apple in fridge" is an ALFWorld task
        target_type = rng.choice(pool)
        if target_type not in APPLIANCES:
            for _ in range(rng.randint(1, 2)):
                add(target_type)
    forbidden = {target_type, appliance}

    def source(closed: bool) -> str:
        pool = [t for t in (OPENABLE if closed else SURFACES + LAMP_HOSTS) if t not in forbidden]
        return add(rng.choice(pool))

    if task_type == "look_at_obj_in_light":
        if f["lamp_away"]:  # the lamp stands on its own desk / sidetable
            src, lamp_host = source(f["src_closed"]), add(rng.choice(LAMP_HOSTS))
        else:
            src = lamp_host = add(rng.choice(LAMP_HOSTS))
    else:
        src = source(f["src_closed"])
        lamp_host = add(rng.choice(LAMP_HOSTS)) if rng.random() < 0.5 else None
    src2 = None
    if task_type == "pick_two":
        src2 = src if f["second"] == "same" else source(f["second"] == "closed")
    for _ in range(n_extra):  # filler receptacles
        add(rng.choice(OPENABLE + SURFACES + LAMP_HOSTS))

    names = list(rtype)
    rng.shuffle(names)
    locs = rng.sample(range(1, 4 * len(names) + 1), len(names))
    openable = {r for r, t in rtype.items() if t in OPENABLE or t in ("fridge", "microwave")}
    contents = {r: [] for r in names}
    where: dict[str, str | None] = {}

    obj_counts: dict[str, int] = {}

    def place(t: str, r: str | None) -> str:
        obj_counts[t] = obj_counts.get(t, 0) + 1
        o = f"{t} {obj_counts[t]}"
        where[o] = r
        if r is not None:
            contents[r].append(o)
        return o

    place(obj_type, src)
    if src2 is not None:
        place(obj_type, src2)
    held = None
    others = [t for t in ALL_OBJECTS if t != obj_type]
    if f["carrying"]:
        held = place(rng.choice(others), None)
    for _ in range(n_distractors):
        place(rng.choice(others), rng.choice(names))
    for r in contents:  # ALFWorld lists contents in no particular order; fix one per seed
        rng.shuffle(contents[r])

    if target_type is None:
        goal = rng.choice(TEMPLATES[task_type]).format(o=obj_type)
    else:
        goal = rng.choice(TEMPLATES[task_type]).format(o=obj_type, r=target_type)
    task = Task(task_type, obj_type, target_type, 2 if task_type == "pick_two" else 1, goal, f)
    world = World(
        rtype=rtype,
        loc=dict(zip(names, locs)),
        openable=openable,
        opened=set(),
        contents=contents,
        where=where,
        at=None if f["start_away"] else src,
        held=held,
        lamp_host=lamp_host,
    )
    return task, world
