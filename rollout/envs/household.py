"""A procedurally generated household in ALFWorld's wording, with an exact expert solver.

The world follows the ALFWorld TextWorld domain (alfworld/data/alfred.pddl): receptacles at
distinct locations, openable ones start closed, the agent holds at most one object, heat / cool /
clean need the agent at the microwave / fridge / sinkbasin (not opened), `use desklamp` toggles
the lamp. Commands and observations use ALFWorld's phrasing so a policy trained here reads the
real games the same way.

Horizon control. A task is drawn from its seed as (task type, feature switches); each switch adds
exactly one necessary command to the shortest plan:
    start_away   the agent starts in the middle of the room, not at the object's receptacle
    src_closed   the (first) object is inside a closed receptacle
    carrying     the agent starts holding an unrelated object it must put down first
    tgt_closed   the target receptacle type is openable (all instances start closed)
    lamp_away    (look_at_obj_in_light) the desklamp is not where the object is
    second       (pick_two) where the second object is: with the first / open / closed receptacle
Only the task's objects have the target type, and none starts in a target-type receptacle or in
the task's appliance, so the constructive plan of `_plan` is a shortest plan and L* = len(plan)
spans 2 (look: take, use) to 12 (pick_two with every switch on).
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass, field
from typing import Any

from rollout.envs.base import EnvError, TextEnv

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
SURFACES = ("countertop", "shelf", "diningtable", "coffeetable", "dresser", "sofa", "armchair",
            "garbagecan", "stoveburner", "bed")
LAMP_HOSTS = ("desk", "sidetable")
# Object types per task type (ALFWorld's own pairings, abridged).
OBJECTS = {
    "pick_and_place": ("apple", "book", "cellphone", "keychain", "pen", "pencil", "creditcard",
                       "vase", "statue", "remotecontrol", "soapbottle", "spraybottle", "cd"),
    "pick_two": ("book", "cellphone", "keychain", "pen", "pencil", "creditcard", "cd",
                 "remotecontrol", "soapbar", "candle", "pillow"),
    "look_at_obj_in_light": ("book", "cellphone", "alarmclock", "pen", "pencil", "keychain",
                             "creditcard", "cd", "bowl", "mug", "statue"),
    "pick_clean_then_place": ("apple", "mug", "plate", "cup", "bowl", "fork", "spoon", "spatula",
                              "ladle", "pan", "pot", "soapbar", "cloth", "lettuce", "tomato"),
    "pick_heat_then_place": ("apple", "bread", "potato", "tomato", "egg", "mug", "cup", "plate"),
    "pick_cool_then_place": ("apple", "bread", "potato", "tomato", "egg", "mug", "cup", "plate",
                             "lettuce", "winebottle", "pan", "pot"),
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
NOTHING = "Nothing happens."
WELCOME = "-= Welcome to TextWorld, ALFRED! =-\n\n"


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
    state: dict[str, set[str]] = field(default_factory=lambda: {"heat": set(), "cool": set(),
                                                                "clean": set()})


def _otype(name: str) -> str:
    return name.rsplit(" ", 1)[0]


# ----------------------------------------------------------------------------- generation


def _sample_task(rng: random.Random, lo: int, hi: int, types: tuple[str, ...]):
    """L* uniform over the reachable lengths in [lo, hi], then type, then features, uniform."""
    rows = [(t, f) for t in types for f in FEATURES[t] if lo <= f["length"] <= hi]
    if not rows:
        raise ValueError(f"no task type among {types} has a plan length in [{lo}, {hi}]")
    length = rng.choice(sorted({f["length"] for _, f in rows}))
    task_type = rng.choice(sorted({t for t, f in rows if f["length"] == length}))
    feats = rng.choice([f for t, f in rows if t == task_type and f["length"] == length])
    return task_type, dict(feats)


def _generate(seed: int, lo: int, hi: int, types: tuple[str, ...], n_extra: int,
              n_distractors: int) -> tuple[Task, World]:
    rng = random.Random(f"household-{seed}")
    task_type, f = _sample_task(rng, lo, hi, types)
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
    world = World(rtype=rtype, loc=dict(zip(names, locs)), openable=openable, opened=set(),
                  contents=contents, where=where, at=None if f["start_away"] else src,
                  held=held, lamp_host=lamp_host)
    return task, world


# ----------------------------------------------------------------------------- expert


def _plan(task: Task, w: World) -> list[str]:
    """Shortest plan from the initial state, built from the generator's structure."""
    plan: list[str] = []
    at, opened, held = w.at, set(w.opened), w.held
    targets = sorted(o for o in w.where if _otype(o) == task.obj_type)[: task.need]

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


# ----------------------------------------------------------------------------- environment

_GO = re.compile(r"^go to (\w+ \d+)$")
_OPEN = re.compile(r"^(open|close) (\w+ \d+)$")
_TAKE = re.compile(r"^take (\w+ \d+) from (\w+ \d+)$")
_PUT = re.compile(r"^put (\w+ \d+) (?:in/on|in|on) (\w+ \d+)$")
_XFORM = re.compile(r"^(heat|cool|clean) (\w+ \d+) with (\w+ \d+)$")
_USE = re.compile(r"^use (\w+ \d+)$")
_EXAMINE = re.compile(r"^examine (\w+ \d+)$")


def _listing(items: list[str]) -> str:
    """ALFWorld's 'a x 1, a y 2, and a z 3' (or 'nothing')."""
    if not items:
        return "nothing"
    items = [f"a {i}" for i in items]
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + ", and " + items[-1]


class HouseholdEnv(TextEnv):
    """Built-in ALFWorld-like world; see the module docstring. Reward is always 0."""

    def __init__(self, max_steps: int = 30, horizon: tuple[int, int] = (2, 12),
                 task_types: tuple[str, ...] | None = None, n_extra_receptacles: int = 4,
                 n_distractors: int = 6, reveal_objects: bool = False):
        super().__init__(max_steps)
        lo, hi = (int(horizon), int(horizon)) if isinstance(horizon, int) else map(int, horizon)
        if not 1 <= lo <= hi:
            raise ValueError(f"horizon must be (lo, hi) with 1 <= lo <= hi, got {horizon}")
        types = tuple(task_types) if task_types else TASK_TYPES
        bad = [t for t in types if t not in TASK_TYPES]
        if bad:
            raise ValueError(f"unknown task_types {bad}; allowed: {', '.join(TASK_TYPES)}")
        if n_extra_receptacles < 0 or n_distractors < 0:
            raise ValueError("n_extra_receptacles and n_distractors must be >= 0")
        _sample_task(random.Random(0), lo, hi, types)  # fail now if the range is empty
        self.horizon, self.task_types = (lo, hi), types
        self.n_extra, self.n_distractors = int(n_extra_receptacles), int(n_distractors)
        # The first observation also says where the task's objects are. ALFWorld does not: its
        # agents search. Revealing them turns the search into planning, which a model small enough
        # to train on a CPU in minutes can learn from the observation (the embedded default).
        self.reveal_objects = bool(reveal_objects)
        self.task: Task | None = None
        self.world: World | None = None
        self._seed_rng = random.Random()

    # -- gym API ---------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is None:
            seed = self._seed_rng.randrange(2**31)
        self.seed_ = int(seed)
        task, world = _generate(self.seed_, *self.horizon, self.task_types, self.n_extra,
                                self.n_distractors)
        return self.start(task, world, task_id=f"household/{self.seed_}")

    def start(self, task: Task, world: World, task_id: str = "household/custom"):
        """Begin an episode on a given task and world (reset uses it; tests hand-build worlds)."""
        self.task, self.world = task, world
        self.plan = _plan(task, world)
        self.steps, self.done, self.won = 0, False, False
        self._picked: set[str] = set()
        self._transformed = False
        self._placed = 0
        self._lit = False
        self.milestones_total = {"pick_two": 4, "look_at_obj_in_light": 2,
                                 "pick_and_place": 2}.get(self.task.task_type, 3)
        info = {
            "task": self.task.goal,
            "admissible_commands": self.admissible_commands(),
            "task_type": self.task.task_type,
            "horizon": len(self.plan),
            "task_id": task_id,
            "won": False,
            "milestones_total": self.milestones_total,
        }
        return self._intro(), info

    def step(self, action: str):
        self._begin_step(action, started=self.world is not None)
        obs, milestone = self._apply(" ".join(action.strip().lower().split()))
        self.done = self.won or self.steps >= self.max_steps
        info = {
            "won": self.won,
            "milestone": milestone is not None,
            "milestone_name": milestone,
            "admissible_commands": self.admissible_commands(),
        }
        return obs, 0.0, self.won, (not self.won) and self.steps >= self.max_steps, info

    # -- text --------------------------------------------------------------------------------

    def _intro(self) -> str:
        w = self.world
        names = sorted(w.rtype, key=lambda r: w.loc[r])
        where = ("You are in the middle of a room." if w.at is None
                 else f"You are at loc {w.loc[w.at]}, in front of the {w.at}.")
        carry = f" You are carrying a {w.held}." if w.held else ""
        seen = ""
        if self.reveal_objects:
            objs = sorted(o for o, r in w.where.items() if r is not None and _otype(o) == self.task.obj_type)
            seen = "".join(f" The {o} is {'in' if w.where[o] in w.openable else 'on'} the {w.where[o]}."
                           for o in objs)
            if self.task.task_type == "look_at_obj_in_light":
                seen += f" The desklamp 1 is on the {w.lamp_host}."
        return (f"{WELCOME}{where} Looking quickly around you, you see {_listing(names)}."
                f"{seen}{carry}\n\nYour task is to: {self.task.goal}")

    def _visible(self, r: str) -> list[str]:
        w = self.world
        items = list(w.contents[r]) if (r not in w.openable or r in w.opened) else []
        if r == w.lamp_host:
            items.append("desklamp 1")
        return items

    def _describe(self, r: str) -> str:
        w = self.world
        if r in w.openable:
            if r not in w.opened:
                return f"The {r} is closed."
            return f"The {r} is open. In it, you see {_listing(self._visible(r))}."
        return f"On the {r}, you see {_listing(self._visible(r))}."

    # -- dynamics ----------------------------------------------------------------------------

    def _apply(self, cmd: str) -> tuple[str, str | None]:
        """Run one command; returns (observation, milestone name or None)."""
        w = self.world
        if cmd == "look":
            if w.at is None:
                return "You are in the middle of a room. Looking quickly around you, you see nothing.", None
            return f"You are facing the {w.at}. Next to it, you see nothing.", None
        if cmd == "inventory":
            return (f"You are carrying: a {w.held}." if w.held else "You are not carrying anything."), None
        if m := _GO.match(cmd):
            r = m[1]
            if r not in w.rtype or r == w.at:
                return NOTHING, None
            w.at = r
            return f"You arrive at loc {w.loc[r]}. {self._describe(r)}", self._lamp_check()
        if m := _OPEN.match(cmd):
            r = m[2]
            if r != w.at or r not in w.openable or ((r in w.opened) == (m[1] == "open")):
                return NOTHING, None
            if m[1] == "close":
                w.opened.discard(r)
                return f"You close the {r}.", None
            w.opened.add(r)
            return f"You open the {r}. {self._describe(r)}", None
        if m := _TAKE.match(cmd):
            return self._take(m[1], m[2])
        if m := _PUT.match(cmd):
            return self._put(m[1], m[2])
        if m := _XFORM.match(cmd):
            return self._transform(m[1], m[2], m[3])
        if m := _USE.match(cmd):
            if m[1] != "desklamp 1" or w.lamp_host is None or w.at != w.lamp_host:
                return NOTHING, None
            w.lamp_on = not w.lamp_on
            word = "on" if w.lamp_on else "off"
            return f"You turn {word} the desklamp 1.", self._lamp_check()
        if m := _EXAMINE.match(cmd):
            return self._examine(m[1]), None
        return NOTHING, None

    def _take(self, o: str, r: str) -> tuple[str, str | None]:
        w = self.world
        if w.held is not None or w.at != r or o not in self._visible(r) or o == "desklamp 1":
            return NOTHING, None
        w.contents[r].remove(o)
        w.where[o], w.held = None, o
        obs = f"You pick up the {o} from the {r}."
        milestone = None
        if _otype(o) == self.task.obj_type and o not in self._picked:
            self._picked.add(o)
            if len(self._picked) <= self.task.need:
                milestone = f"picked {o}"
        lit = self._lamp_check()  # the lamp may already be on here: both facts in one step
        return obs, "; ".join(m for m in (milestone, lit) if m) or None

    def _put(self, o: str, r: str) -> tuple[str, str | None]:
        w = self.world
        if w.held != o or w.at != r or (r in w.openable and r not in w.opened):
            return NOTHING, None
        w.contents[r].append(o)
        w.where[o], w.held = r, None
        return f"You put the {o} in/on the {r}.", self._place_check()

    def _transform(self, verb: str, o: str, r: str) -> tuple[str, str | None]:
        w = self.world
        app = {"heat": "microwave", "cool": "fridge", "clean": "sinkbasin"}[verb]
        if w.held != o or w.at != r or w.rtype.get(r) != app:
            return NOTHING, None
        w.state[verb].add(o)
        if verb == "heat":
            w.state["cool"].discard(o)
        elif verb == "cool":
            w.state["heat"].discard(o)
        milestone = None
        want = TRANSFORMS.get(self.task.task_type, (None,))[0]
        if verb == want and _otype(o) == self.task.obj_type and not self._transformed:
            self._transformed = True
            milestone = f"{verb}ed {o}" if verb != "clean" else f"cleaned {o}"
        return f"You {verb} the {o} using the {r}.", milestone

    def _examine(self, x: str) -> str:
        w = self.world
        if x in w.rtype:
            return self._describe(x) if x == w.at else NOTHING
        if x == "desklamp 1" and w.at == w.lamp_host and w.lamp_host:
            return f"The desklamp 1 is turned {'on' if w.lamp_on else 'off'}."
        if x == w.held or (w.at is not None and x in self._visible(w.at)):
            return f"There's nothing special about {x}."
        return NOTHING

    # -- goal facts --------------------------------------------------------------------------

    def _satisfies(self, o: str) -> bool:
        if _otype(o) != self.task.obj_type:
            return False
        want = TRANSFORMS.get(self.task.task_type, (None,))[0]
        return want is None or o in self.world.state[want]

    def _place_check(self) -> str | None:
        """Milestone when the number of goal objects in target receptacles reaches a new high."""
        t = self.task
        if t.target_type is None:
            return None
        w = self.world
        n = sum(1 for r, objs in w.contents.items() if w.rtype[r] == t.target_type
                for o in objs if self._satisfies(o))
        n = min(n, t.need)
        if n <= self._placed:
            return None
        self._placed = n
        self.won = n >= t.need
        return f"placed {n} {t.obj_type} in {t.target_type}"

    def _lamp_check(self) -> str | None:
        """look_at_obj_in_light: holding the object at the lit lamp (fires once, = won)."""
        w = self.world
        if (self.task.task_type != "look_at_obj_in_light" or self._lit or not w.lamp_on
                or w.at != w.lamp_host or w.held is None or _otype(w.held) != self.task.obj_type):
            return None
        self._lit = self.won = True
        return f"looked at {w.held} under the desklamp"

    def admissible_commands(self) -> list[str]:
        w = self.world
        cmds = ["inventory", "look"]
        cmds += [f"go to {r}" for r in w.rtype if r != w.at]
        if w.held:
            cmds.append(f"examine {w.held}")
        r = w.at
        if r is not None:
            cmds.append(f"examine {r}")
            if r in w.openable:
                cmds.append(f"{'close' if r in w.opened else 'open'} {r}")
            visible = self._visible(r)
            if w.held is None:
                cmds += [f"take {o} from {r}" for o in visible if o != "desklamp 1"]
            elif r not in w.openable or r in w.opened:
                cmds.append(f"put {w.held} in/on {r}")
            if w.held is not None:
                t = w.rtype[r]
                verb = {"microwave": "heat", "fridge": "cool", "sinkbasin": "clean"}.get(t)
                if verb:
                    cmds.append(f"{verb} {w.held} with {r}")
            if r == w.lamp_host:
                cmds.append("use desklamp 1")
            cmds += [f"examine {o}" for o in visible]
        return sorted(set(cmds))


def expert_plan(env: HouseholdEnv) -> list[str]:
    """The expert's shortest plan for the env's current task, from its initial state."""
    if env.task is None:
        raise EnvError("expert_plan() before reset()")
    return list(env.plan)


def solve(seed: int, **env_kwargs) -> list[str]:
    """Expert plan for task `seed` of a HouseholdEnv built with `env_kwargs`."""
    env = HouseholdEnv(**env_kwargs)
    env.reset(seed=seed)
    return expert_plan(env)
