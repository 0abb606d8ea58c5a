"""Real ALFWorld text games on TextWorld's PDDL engine (the engine `AlfredTWEnv` uses).

Games come from a data folder holding `json_2.1.1/{train,valid_seen,valid_unseen}/<task>/<trial>/`
with `game.tw-pddl` (PDDL domain, problem and grammar) and `traj_data.json` (task type, pddl_params,
the ALFRED expert's high-level plan). `reset(seed=s)` plays game `s % num_tasks` of the split in
sorted path order; L* = len(high_level_plan).

Speed. Stock TextWorld re-translates the PDDL problem to SAS twice on every reset (~1 s) and
re-parses grammar strings with TatSu and deep-copies the whole derivation context for every
admissible command on every step (~0.2 s). This module keeps the engine but (a) caches the SAS
translation per game and reloads it into the C planner library on reset, (b) memoises the two pure
parse functions and makes the derivation context copy shallow (the derivation only rebinds keys
of the copied dicts, it never mutates the entity objects). Observations and admissible commands
are unchanged; tests compare them with stock TextWorld's. With `cache_dir`, translations are also
kept on disk (keyed by the game file's content), so other workers and later runs load a new game
in ~20 ms instead of ~1 s.

Milestones (ALGORITHMS.md section 4):
  "facts" (default): a goal-relevant fact becomes true for the first time, read from the engine's
      PDDL facts: k-th distinct target object held (k <= number to place), target object
      hot / cool / clean / sliced, toggle target (lamp) toggled, k-th target object (satisfying
      the transform) in a receptacle of the parent type. Types come from traj_data pddl_params.
  "expert_plan": the next high-level plan step is matched exactly (verb and object/receptacle
      types, instance numbers dropped), in order. A GotoLocation to an object type (e.g. the
      desklamp) matches going to the receptacle that holds such an object.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import pickle
import random
import re
import sys
import zlib
from collections import Counter, OrderedDict, defaultdict
from typing import Any

from rollout.envs.base import EnvError, GamesNotFoundError, TextEnv

SPLITS = ("train", "valid_seen", "valid_unseen")
MILESTONE_MODES = ("facts", "expert_plan")
TRANSFORM_FACTS = {  # task type -> the PDDL predicate its transform makes true
    "pick_heat_then_place_in_recep": "ishot",
    "pick_cool_then_place_in_recep": "iscool",
    "pick_clean_then_place_in_recep": "isclean",
}
NOTHING = "Nothing happens."


# ----------------------------------------------------------------------------- engine speed-ups


@functools.cache
def _install_textworld_speedups() -> None:
    """Memoise TextWorld's pure grammar/query parsers and make context copies shallow (once)."""
    import textworld.envs.pddl.textgen as tg
    from textworld.logic import Rule

    parse = tg._parse_and_convert
    parsed: dict[tuple, Any] = {}

    def cached_parse(text, rule_name, **kw):
        key = (text, rule_name)
        if key not in parsed:
            parsed[key] = parse(text, rule_name=rule_name)
        return copy.deepcopy(parsed[key])  # derivation sets .context on the symbols it gets

    query = Rule.parse_conjunctive_query.__func__
    cached_query = functools.lru_cache(maxsize=None)(lambda expr: query(Rule, expr))

    def shallow_context(context):
        return {
            "state": context["state"],
            "facts": context["facts"],
            "variables": dict(context["variables"]),
            "mapping": dict(context["mapping"]),
            "entity_infos": context["entity_infos"],
        }

    tg._parse_and_convert = cached_parse
    tg.copy_context = shallow_context
    Rule.parse_conjunctive_query = staticmethod(cached_query)


def _pddl2sas(domain: str, problem: str):
    """fast_downward's translation; it overwrites sys.argv, so put it back."""
    import fast_downward

    argv = list(sys.argv)
    try:
        return fast_downward.pddl2sas(domain, problem)
    finally:
        sys.argv[:] = argv


def _engine_classes():
    """Subclasses of TextWorld's PDDL env/state that reload a cached SAS task on reset."""
    from textworld.core import GameState
    from textworld.envs.pddl import logic as pddl_logic
    from textworld.envs.pddl.pddl import PddlEnv
    from textworld.logic import Proposition, Type, Variable

    class CachedState(pddl_logic.PddlState):
        # Mirrors PddlState.__init__ minus the two PDDL->SAS translations and the replanner.
        def __init__(self, downward_lib, logic, task, sas, init_facts):
            self._facts, self._vars_by_name = defaultdict(set), {}
            self._vars_by_type, self._var_counts = defaultdict(set), Counter()
            self._logic, self.downward_lib, self.pddl_problem = logic, downward_lib, None
            self.task, self.sas = task, sas
            self._actions = {a.name: a for a in task.actions}
            self.name2type = {o.name: o.type_name for o in task.objects}
            downward_lib.load_sas(sas.encode("utf-8"))
            self.add_facts(init_facts)

        def replan(self, infos):
            raise EnvError("the ALFWorld env does not run the planner (policy_commands)")

    class FastPddlEnv(PddlEnv):
        """PddlEnv whose load/reset reuse a per-game cache (logic, SAS task, initial facts)."""

        cache_dir: str | None = None

        def load(self, path: str) -> None:
            self._game_file = path
            entry = _GAME_CACHE.get(path)
            if entry is None:
                entry = _GAME_CACHE.put(path, self._translate(path))
            self._logic, self._task, self._sas, self._init_facts = entry
            self.walkthrough = None
            self._pddl_state = self._new_state()
            self._entity_infos = self._get_entity_infos()

        def _translate(self, path: str):
            with open(path, "rb") as f:
                raw = f.read()
            disk = None
            if self.cache_dir:  # translations shared by workers and runs, keyed by content
                disk = os.path.join(self.cache_dir, hashlib.sha1(raw).hexdigest() + ".pkl.z")
                if os.path.exists(disk):
                    with open(disk, "rb") as f:
                        return pickle.loads(zlib.decompress(f.read()))
            entry = self._translate_text(json.loads(raw))
            if disk:
                os.makedirs(self.cache_dir, exist_ok=True)
                tmp = f"{disk}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    f.write(zlib.compress(pickle.dumps(entry, protocol=5), 1))
                os.replace(tmp, disk)  # atomic: concurrent workers never read half a file
            return entry

        def _translate_text(self, data: dict):
            logic = pddl_logic.GameLogic(domain=data["pddl_domain"], grammar=data["grammar"])
            task, sas = _pddl2sas(logic.domain, data["pddl_problem"])
            for t in task.types:
                try:
                    logic.types.add(Type(t.name, t.supertype_names))
                except ValueError:
                    pass
            # Initial facts exactly as PddlState computes them: PDDL init, then the SAS state.
            name2type = {o.name: o.type_name for o in task.objects}
            facts = []
            for atom in task.init:
                fact = _atom_fact(atom, name2type, Proposition, Variable)
                if fact is not None:
                    facts.append(fact)
            self.downward_lib.load_sas(sas.encode("utf-8"))
            atoms = (pddl_logic.Atom * self.downward_lib.get_state_size())()
            self.downward_lib.get_state(atoms)
            facts += [f for f in (a.get_fact(name2type) for a in atoms) if not f.is_negation]
            return logic, task, sas, facts

        def _new_state(self):
            return CachedState(self.downward_lib, self._logic, self._task, self._sas, self._init_facts)

        def reset(self):
            self._pddl_state = self._new_state()
            self.prev_state, self.state = None, GameState()
            self._last_action, self._moves = None, 0
            context = {
                "state": self._pddl_state,
                "facts": list(self._pddl_state.facts),
                "variables": {},
                "mapping": {},
                "entity_infos": self._entity_infos,
            }
            self.state.feedback = self._logic.grammar.derive("#intro#", context)
            self.state.raw = self.state.feedback
            self._gather_infos()
            return self.state

    return FastPddlEnv


def _atom_fact(atom, name2type, Proposition, Variable):
    """PddlState's _atom2proposition (a closure there, so restated)."""
    import fast_downward

    if isinstance(atom, fast_downward.translate.pddl.conditions.Atom):
        if atom.predicate == "=":
            return None
        return Proposition(atom.predicate, [Variable(a, name2type[a]) for a in atom.args])
    if isinstance(atom, fast_downward.translate.pddl.f_expression.Assign):
        if atom.fluent.symbol == "total-cost":
            return None
        name = f"{atom.expression.value}"
        if str.isdigit(name):
            return None
        return Proposition(name, [Variable(a, name2type[a]) for a in atom.fluent.args])
    return None


class _LRU:
    def __init__(self, size: int):
        self.size, self.data = size, OrderedDict()

    def get(self, key):
        if key in self.data:
            self.data.move_to_end(key)
        return self.data.get(key)

    def put(self, key, value):
        self.data[key] = value
        while len(self.data) > self.size:
            self.data.popitem(last=False)
        return value


_GAME_CACHE = _LRU(int(os.environ.get("STRATA_ALFWORLD_CACHE", "128")))


# ----------------------------------------------------------------------------- games on disk


def list_games(data_dir: str, split: str) -> list[str]:
    """Game folders of a split (relative to json_2.1.1/), sorted; AlfredTWEnv's path filter."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    root = os.path.join(os.fspath(data_dir), "json_2.1.1")
    split_dir = os.path.join(root, split)
    if not os.path.isdir(split_dir):
        archive = "train.tar.xz" if split == "train" else "eval.tar.xz"
        raise GamesNotFoundError(
            f"ALFWorld games not found: {split_dir} does not exist. Unpack them into the data dir: "
            f"tar xJf ../shared/data/alfworld/{archive} -C {data_dir}"
        )
    games = []
    for dirpath, _, files in os.walk(split_dir):
        if "traj_data.json" in files and "game.tw-pddl" in files:
            if "movable" in dirpath or "Sliced" in dirpath:
                continue  # AlfredTWEnv skips these too
            games.append(os.path.relpath(dirpath, root))
    if not games:
        raise GamesNotFoundError(f"no ALFWorld games (traj_data.json + game.tw-pddl) under {split_dir}")
    return sorted(games)


def _norm_type(name: str) -> str:
    return name.strip().lower().removesuffix("type")


# ----------------------------------------------------------------------------- milestones


class FactMilestones:
    """Goal-relevant PDDL facts, each counted the first time it becomes true."""

    def __init__(self, task_type: str, params: dict, facts, names: dict[str, str]):
        self.obj = params.get("object_target", "").lower()
        self.parent = params.get("parent_target", "").lower()
        self.toggle = params.get("toggle_target", "").lower()
        self.sliced = bool(params.get("object_sliced", False))
        self.transform = TRANSFORM_FACTS.get(task_type)
        self.need = 2 if task_type == "pick_two_obj_and_place" else 1
        self.names = names
        types = {}
        for f in facts:  # static typing facts: object / receptacle -> type
            if f.name in ("objecttype", "receptacletype"):
                types[f.arguments[0].name] = _norm_type(f.arguments[1].name)
        self.targets = {o for o, t in types.items() if t == self.obj}
        self.parents = {r for r, t in types.items() if t == self.parent} if self.parent else set()
        self.toggles = {o for o, t in types.items() if t == self.toggle} if self.toggle else set()
        self.held: set[str] = set()
        self.done: set[str] = set()
        self.placed = 0
        self.total = (
            self.need
            + (1 if self.transform else 0)
            + int(self.sliced)
            + int(bool(self.toggle))
            + (self.need if self.parent else 0)
        )
        self.update(facts)  # facts already true at the start are not milestones

    def update(self, facts) -> str | None:
        """Names of the goal facts that became true at this state (joined), or None."""
        props: dict[str, set] = defaultdict(set)
        for f in facts:
            if f.name in ("holds", "ishot", "iscool", "isclean", "issliced", "istoggled", "inreceptacle"):
                props[f.name].add(tuple(a.name for a in f.arguments))
        new = []
        for _, o in props["holds"]:
            if o in self.targets and o not in self.held:
                self.held.add(o)
                if len(self.held) <= self.need:
                    new.append(f"holds {self.names.get(o, o)}")
        for pred, wanted in ((self.transform, True), ("issliced", self.sliced)):
            if pred and wanted and pred not in self.done:
                hit = [o for (o,) in props[pred] if o in self.targets]
                if hit:
                    self.done.add(pred)
                    new.append(f"{pred} {self.names.get(hit[0], hit[0])}")
        if self.toggles and "istoggled" not in self.done:
            hit = [o for (o,) in props["istoggled"] if o in self.toggles]
            if hit:
                self.done.add("istoggled")
                new.append(f"istoggled {self.names.get(hit[0], hit[0])}")
        if self.parents:
            ok = {
                o
                for o in self.targets
                if (not self.transform or (o,) in props[self.transform])
                and (not self.sliced or (o,) in props["issliced"])
            }
            n = min(self.need, sum(1 for (o, r) in props["inreceptacle"] if o in ok and r in self.parents))
            if n > self.placed:
                self.placed = n
                new.append(f"{n} {self.obj} in {self.parent}")
        return "; ".join(new) or None


_ACTION_RE = [
    (re.compile(r"^go to (\w+) \d+$"), lambda m: ("GotoLocation", (m[1],))),
    (re.compile(r"^take (\w+) \d+ from \w+ \d+$"), lambda m: ("PickupObject", (m[1],))),
    (re.compile(r"^put (\w+) \d+ in/on (\w+) \d+$"), lambda m: ("PutObject", (m[1], m[2]))),
    (re.compile(r"^heat (\w+) \d+ with \w+ \d+$"), lambda m: ("HeatObject", (m[1],))),
    (re.compile(r"^cool (\w+) \d+ with \w+ \d+$"), lambda m: ("CoolObject", (m[1],))),
    (re.compile(r"^clean (\w+) \d+ with \w+ \d+$"), lambda m: ("CleanObject", (m[1],))),
    (re.compile(r"^slice (\w+) \d+ with \w+ \d+$"), lambda m: ("SliceObject", (m[1],))),
    (re.compile(r"^use (\w+) \d+$"), lambda m: ("ToggleObject", (m[1],))),
]


def normalise_action(command: str) -> tuple[str, tuple[str, ...]] | None:
    """An ALFWorld command as a high-level plan step (verb, types), or None (open, look, ...)."""
    for pattern, build in _ACTION_RE:
        if m := pattern.match(command):
            return build(m)
    return None


class PlanMilestones:
    """BEACON reference-code alternative: exact, in-order matching against the expert plan."""

    def __init__(self, plan: list):
        self.plan = [(a, tuple(x.lower() for x in args)) for a, args in plan]
        self.next = 0
        self.total = len(self.plan)

    def update(self, command: str, contents_of) -> str | None:
        if self.next >= len(self.plan):
            return None
        step = normalise_action(command)
        want = self.plan[self.next]
        if step is None:
            return None
        hit = step == want
        if not hit and step[0] == want[0] == "GotoLocation":
            hit = want[1][0] in contents_of(command[len("go to ") :])  # e.g. "go to desklamp"
        if not hit:
            return None
        self.next += 1
        return f"plan step {self.next}: {want[0]} {' '.join(want[1])}"


# ----------------------------------------------------------------------------- environment


class AlfWorldEnv(TextEnv):
    """One ALFWorld split as a TextEnv (see the module docstring)."""

    def __init__(
        self,
        data_dir: str,
        split: str = "train",
        max_steps: int = 50,
        milestones: str = "facts",
        task_types: tuple[str, ...] | None = None,
        cache_dir: str | None = None,
    ):
        super().__init__(max_steps)
        if milestones not in MILESTONE_MODES:
            raise ValueError(f"unknown milestones {milestones!r}; allowed: {', '.join(MILESTONE_MODES)}")
        self.data_dir, self.split, self.milestones = os.fspath(data_dir), split, milestones
        # Optional folder for the per-game PDDL->SAS translations (~1 s each, 20 ms from disk).
        self.cache_dir = os.fspath(cache_dir) if cache_dir else None
        games = list_games(self.data_dir, split)
        if task_types:
            games = [g for g in games if g.split(os.sep)[1].split("-")[0] in set(task_types)]
            if not games:
                raise ValueError(f"no {split} games of task types {task_types}")
        self.games = games
        self._env = None
        self._loaded: str | None = None
        self._seed_rng = random.Random()
        self.done = True
        self.started = False

    @property
    def num_tasks(self) -> int:
        return len(self.games)

    def _engine(self):
        if self._env is None:
            import textworld
            from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

            _install_textworld_speedups()
            infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
            env = _engine_classes()(infos)
            env.cache_dir = self.cache_dir
            for wrapper in (AlfredDemangler(shuffle=False), AlfredInfos):
                env = wrapper(env)
            self._env = env
        return self._env

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is None:
            seed = self._seed_rng.randrange(2**31)
        game = self.games[int(seed) % len(self.games)]
        game_dir = os.path.join(self.data_dir, "json_2.1.1", game)
        with open(os.path.join(game_dir, "traj_data.json")) as f:
            traj = json.load(f)
        env = self._engine()
        try:
            if self._loaded != game:
                env.load(os.path.join(game_dir, "game.tw-pddl"))
                self._loaded = game
            state = env.reset()
        except Exception as e:  # noqa: BLE001 - any engine failure is reported as an EnvError
            self._loaded = None
            raise EnvError(f"ALFWorld engine failed to reset {game}: {type(e).__name__}: {e}") from e
        self.traj, self.state, self.steps = traj, state, 0
        self.done, self.won, self.started = False, False, True
        self.names = {k: info.name for k, info in env.unwrapped._entity_infos.items()}
        if self.milestones == "facts":
            self.tracker = FactMilestones(traj["task_type"], traj["pddl_params"], state["_facts"], self.names)
        else:
            self.tracker = PlanMilestones(traj["high_level_plan"])
        obs = state.feedback
        goal = obs.split("Your task is to: ", 1)[-1].strip()
        info = {
            "task": goal,
            "admissible_commands": list(state["admissible_commands"]),
            "task_type": traj["task_type"],
            "horizon": len(traj["high_level_plan"]),
            "task_id": game,
            "won": False,
            "milestones_total": self.tracker.total,
            "gamefile": os.path.join(game_dir, "game.tw-pddl"),
        }
        return obs, info

    def step(self, action: str):
        self._begin_step(action, started=self.started)
        command = " ".join(action.lower().split())
        milestone = None
        if command == "":  # the no-op: the engine is not touched
            obs = NOTHING
        else:
            try:
                self.state, _, _ = self._env.step(command)
            except Exception as e:  # noqa: BLE001
                self.done = True
                raise EnvError(f"ALFWorld engine failed on {command!r}: {type(e).__name__}: {e}") from e
            obs = self.state.feedback
            if self._env.unwrapped._last_action is not None:  # the command was a valid action
                milestone = self._milestone(command)
        self.won = bool(self.state["won"])
        truncated = not self.won and self.steps >= self.max_steps
        self.done = self.won or truncated
        info = {
            "won": self.won,
            "milestone": milestone is not None,
            "milestone_name": milestone,
            "admissible_commands": list(self.state["admissible_commands"]),
        }
        return obs, 0.0, self.won, truncated, info

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env, self._loaded = None, None

    def _milestone(self, command: str) -> str | None:
        if self.milestones == "facts":
            return self.tracker.update(self.state["_facts"])
        return self.tracker.update(command, self._contents)

    def _contents(self, receptacle: str) -> set[str]:
        """Object types in a receptacle (by display name), from the engine's facts."""
        by_name = {v: k for k, v in self.names.items()}
        rid = by_name.get(receptacle)
        return {
            self.names.get(f.arguments[0].name, "").rsplit(" ", 1)[0]
            for f in self.state["_facts"]
            if f.name == "inreceptacle" and f.arguments[1].name == rid
        }
