"""An offline WebShop-style store (Yao et al. 2022): search, results, item pages, options, buy.

Pages and actions follow WebShop's text environment as verl-agent prompts it. The agent starts on
the search page, where the one admissible action is the template `search[<your query>]` (any
`search[...]` matches it, see rollout/parsing.py); every other page lists its buttons as
`click[...]`:

    results      back to search, < prev (past page 1), next > (when more), the product ids listed
    item         back to search, < prev (to the results), each option value, description,
                 features, buy now
    description  back to search, < prev (to the item)
    features     back to search, < prev

Clicking an item clears the selected options; clicking an option value selects it (a second value
of the same option replaces the first); `buy now` ends the episode with WebShop's score. Texts are
lowercase and the parts of a page are joined by " [SEP] ", as in WebShop's text mode; the
instruction is not repeated on every page (verl-agent strips it too: the prompt carries the task).
A step that changes nothing (the "" no-op of an invalid model output, an unknown command, a button
not on the page) answers "nothing happens. [SEP] <the same page>" and is counted in `env.noops`;
the rollout loop counts invalid model outputs itself (stats "invalid/<reason>"), as for household.

Instructions are built from a real target product of the catalogue (rollout/envs/shop_catalog.py):
"i need <attributes> <type>, with color: red, and size: 9, and price lower than 40.00 dollars",
with 1-3 of its attributes, 0-3 of its options and WebShop's price bound (the larger of two of
the four multiples of ten above its price).

Reward: WebShop's get_reward (web_agent_site/engine/goal.py), on structured data:
    total = r_type * (#attributes matched + #options matched + [price <= bound])
                   / (#goal attributes + #goal options + 1)
    r_type = 1 if (same category or >= 2 shared category-path parts or title_score > 0.2),
             else 0.5; then 0.1 if title_score < 0.1, and 0 if title_score == 0,
    title_score = |type words of the purchase & of the goal| / |type words of the goal|.
Simplifications, because the catalogue is structured: WebShop's fuzzy attribute match (against
attributes, title, bullets, description) is exact set membership (a catalogue title spells every
attribute of its product and no other); its option match (exact for size, fuzzy otherwise, or found
in the page text) is equality of the selected value per option name; the spaCy nouns of the names
are the words of the type phrases (they are noun phrases). The score is in [0, 1]; won = score == 1.

Return: `buy now` gives the score as the step reward and ends the episode (terminated even when the
score is below 1: WebShop's episode is over at the purchase). The rollout loop adds the env reward to
R for this environment (rollout/envs/__init__.py REWARD_IN_RETURN), so R = r_succ * won + score: a
full match earns r_succ + 1, a partial purchase its score < 1, no purchase 0. Success dominates;
among failures a closer purchase ranks higher.

Expert and horizon. The expert is privileged: it knows which listings offer the wanted options,
which an agent sees only on their item pages. It searches the instruction's own query (the words
between "i need " and the first comma), clicks `next >` up to the page holding the best-ranked
product that can score 1, clicks it, clicks each goal option, and buys: L* = 3 + pages turned +
goal options, the shortest plan among those searching the instruction's query (tests check it by
breadth-first search; a sharper query could shorten the pagination). The task generator draws L*
uniformly over the lengths reachable in [horizon_min, horizon_max] (3-10 with 10 results a page),
then a target and goal whose expert plan has that length.

Milestones (in order): a results page shows a product that can score 1; such a product's page is
opened; each goal option is selected on such a page; the purchase scores 1 (= won).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import Any

from rollout.envs.base import EnvError, TextEnv
from rollout.envs.shop_catalog import Catalog, Product, get_catalog

SEP = " [SEP] "
SEARCH = "search[<your query>]"
PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # WebShop's price bounds
NO_BOUND = 1_000_000.0  # WebShop's bound when fewer than two multiples of ten below 1000 exceed the price
NOTHING = "nothing happens."
MIN_LENGTH = 3  # search, click the item, buy
ATTEMPTS = 400  # candidates drawn per plan length before another length is drawn


@dataclass(frozen=True)
class Goal:
    target: str  # pid of the product the instruction was written from
    category: int
    department: str
    type: str
    path: tuple[str, str, str]
    attributes: tuple[str, ...]
    options: tuple[tuple[str, str], ...]  # (option name, value), in page order
    price_upper: float
    instruction: str
    query: str  # the instruction's product phrase: what the expert searches


# ----------------------------------------------------------------------------- reward


def type_reward(catalog: Catalog, product: Product, goal: Goal) -> float:
    """WebShop's r_type on structured data (see the module docstring)."""
    cat = catalog.categories[product.category]
    query_match = product.category == goal.category  # WebShop: the same scraping query
    category_match = len(set(cat.path) & set(goal.path)) >= 2
    want = set(goal.type.split())
    title_score = len(set(cat.type.split()) & want) / len(want)
    r = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r = 0.5
    if title_score < 0.1:
        r = 0.1
    if title_score == 0.0:
        r = 0.0
    return r


def score(catalog: Catalog, product: Product, goal: Goal, selected: dict[str, str]) -> tuple[float, dict]:
    """WebShop's total reward of buying `product` with options `selected` -> (score, parts)."""
    r_type = type_reward(catalog, product, goal)
    n_att = sum(a in product.attributes for a in goal.attributes)
    n_opt = sum(selected.get(k) == v for k, v in goal.options)
    r_price = product.price <= goal.price_upper
    total = r_type * (n_att + n_opt + int(r_price)) / (len(goal.attributes) + len(goal.options) + 1)
    return total, {"r_type": r_type, "attributes": n_att, "options": n_opt, "price": bool(r_price)}


def can_win(catalog: Catalog, product: Product, goal: Goal) -> bool:
    """Buying `product` with the goal's options would score 1."""
    if product.price > goal.price_upper or not set(goal.attributes) <= product.attributes:
        return False
    offered = dict(catalog.options(product))
    if any(v not in offered.get(k, ()) for k, v in goal.options):
        return False
    return type_reward(catalog, product, goal) == 1.0


@functools.lru_cache(maxsize=4096)  # per (catalogue, goal): a task's G resets share it
def winners(catalog: Catalog, goal: Goal) -> frozenset[int]:
    """Indices of every product that can score 1 (they all have every goal attribute)."""
    sets = [catalog.by_attribute.get(a, frozenset()) for a in goal.attributes]
    cand = frozenset.intersection(*sets) if sets else frozenset(range(len(catalog.products)))
    return frozenset(i for i in cand if can_win(catalog, catalog.products[i], goal))


# ----------------------------------------------------------------------------- tasks


def price_upper(rng: random.Random, price: float) -> float:
    """WebShop's bound: the larger of two of the four multiples of ten above the price."""
    above = [p for p in PRICE_RANGE if p > price][:4]
    if len(above) < 2:
        return NO_BOUND
    return sorted(rng.sample(above, 2))[1]


def make_goal(
    catalog: Catalog, target: Product, attributes: list[str], options: list[tuple[str, str]], upper: float
) -> Goal:
    cat = catalog.categories[target.category]
    query = f"{' and '.join(attributes)} {cat.type}"
    text = f"i need {query}"
    if options:
        text += ", with " + ", and ".join(f"{k}: {v}" for k, v in options)
    if upper < NO_BOUND:
        text += f", and price lower than {upper:.2f} dollars"
    return Goal(
        target.pid, cat.index, cat.department, cat.type, cat.path, tuple(attributes), tuple(options), upper, text, query
    )


def expert_page(catalog: Catalog, goal: Goal, results: list[int], page_size: int) -> tuple[int, int] | None:
    """(page index, product index) of the best-ranked product that can score 1, or None."""
    for rank, i in enumerate(results):
        if can_win(catalog, catalog.products[i], goal):
            return rank // page_size, i
    return None


def max_options(catalog: Catalog) -> int:
    return max(len(c.options) for c in catalog.categories)


def reachable_lengths(lo: int, hi: int, page_size: int, num_results: int, n_options: int) -> list[int]:
    """Plan lengths in [lo, hi] the results pages and option counts allow (3 + page + options)."""
    top = MIN_LENGTH + (math.ceil(num_results / page_size) - 1) + n_options
    return list(range(max(lo, MIN_LENGTH), min(hi, top) + 1))


@functools.lru_cache(maxsize=8192)
def generate(
    seed: int, lo: int, hi: int, catalog_seed: int, num_products: int, page_size: int, num_results: int
) -> tuple[Goal, int, int]:
    """(goal, expert page, expert product index) of task `seed`; deterministic in all arguments.

    L* is drawn uniformly from the reachable lengths in [lo, hi]. Then candidates are drawn (a
    product, 1-3 of its attributes, its price bound, a value of each of its options in a random
    order); a candidate with expert page p_k for its first k options has length 3 + p_k + k, and
    the first candidate and k giving L* is the task.
    """
    catalog = get_catalog(catalog_seed, num_products)
    lengths = reachable_lengths(lo, hi, page_size, num_results, max_options(catalog))
    if not lengths:
        raise ValueError(f"no shop task has a plan length in [{lo}, {hi}]")
    rng = random.Random(f"shop-{seed}")
    for _ in range(20):  # a length no candidate reaches in ATTEMPTS draws is drawn again
        length = rng.choice(lengths)
        for _ in range(ATTEMPTS):
            target = rng.choice(catalog.products)
            attrs = sorted(target.attributes)
            rng.shuffle(attrs)
            attrs = attrs[: rng.choice((1, 1, 2, 2, 3))]
            upper = price_upper(rng, target.price)
            order = {name: j for j, (name, _) in enumerate(target.options)}
            chosen = [(name, rng.choice(values)) for name, values in target.options]
            rng.shuffle(chosen)
            k_max = min(len(chosen), length - MIN_LENGTH)
            query = make_goal(catalog, target, attrs, [], upper).query
            results = catalog.search(query, num_results)
            for k in range(k_max, -1, -1):  # every k shares the one search
                opts = sorted(chosen[:k], key=lambda kv: order[kv[0]])
                goal = make_goal(catalog, target, attrs, opts, upper)
                found = expert_page(catalog, goal, results, page_size)
                if found is not None and MIN_LENGTH + found[0] + k == length:
                    return goal, found[0], found[1]
    raise EnvError(f"shop task {seed}: no candidate reaches a plan length in {lengths}")


# ----------------------------------------------------------------------------- environment


class ShopEnv(TextEnv):
    """The store; see the module docstring. Reward: WebShop's score at `buy now`, else 0."""

    def __init__(
        self,
        max_steps: int = 15,
        horizon: tuple[int, int] = (3, 9),
        catalog_seed: int = 0,
        num_products: int = 24000,
        page_size: int = 10,
        num_results: int = 50,
    ):
        super().__init__(max_steps)
        lo, hi = (int(horizon), int(horizon)) if isinstance(horizon, int) else map(int, horizon)
        if not 1 <= lo <= hi:
            raise ValueError(f"horizon must be (lo, hi) with 1 <= lo <= hi, got {horizon}")
        if page_size < 1 or num_results < 1:
            raise ValueError(f"page_size={page_size} and num_results={num_results} must be >= 1")
        if num_products < 1000:
            raise ValueError(f"num_products={num_products}: search needs a catalogue of at least 1000")
        self.catalog = get_catalog(int(catalog_seed), int(num_products))
        n_opts = max_options(self.catalog)
        if not reachable_lengths(lo, hi, page_size, num_results, n_opts):
            raise ValueError(
                f"no shop task has a plan length in [{lo}, {hi}]: the shortest is {MIN_LENGTH}, the "
                f"longest {MIN_LENGTH + math.ceil(num_results / page_size) - 1 + n_opts} with "
                f"page_size={page_size}, num_results={num_results}"
            )
        self.horizon = (lo, hi)
        self.catalog_seed, self.num_products = int(catalog_seed), int(num_products)
        self.page_size, self.num_results = int(page_size), int(num_results)
        self.goal: Goal | None = None
        self.noops = 0  # steps that changed nothing (the "" no-op, unknown or inadmissible actions)
        self._seed_rng = random.Random()

    # -- gym API ---------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is None:
            seed = self._seed_rng.randrange(2**31)
        self.seed_ = int(seed)
        goal, _, _ = generate(
            self.seed_, *self.horizon, self.catalog_seed, self.num_products, self.page_size, self.num_results
        )
        return self.start(goal, task_id=f"shop/{self.seed_}")

    def start(self, goal: Goal, task_id: str = "shop/custom"):
        """Begin an episode on a given goal (reset uses it; tests build goals by hand). A goal that
        no product in its query's results can win has no expert plan: horizon -1."""
        self.goal = goal
        self.winners = winners(self.catalog, goal)
        self.plan = self._plan()
        self.steps, self.done, self.won, self.noops = 0, False, False, 0
        self.page, self.results, self.page_no, self.item = "search", [], 0, None
        self.selected: dict[str, str] = {}
        self.bought: tuple[str, float] | None = None
        self._seen_results = self._opened = False
        self._options_done: set[str] = set()
        self.milestones_total = 2 + len(goal.options) + 1
        info = {
            "task": goal.instruction,
            "admissible_commands": self.admissible_commands(),
            "task_type": goal.department,
            "horizon": len(self.plan) if self.plan else -1,
            "task_id": task_id,
            "won": False,
            "milestones_total": self.milestones_total,
        }
        return self.observation(), info

    def step(self, action: str):
        self._begin_step(action, started=self.goal is not None)
        reward, milestone, changed = self._apply(" ".join(action.strip().lower().split()))
        if not changed:
            self.noops += 1
        obs = self.observation() if changed else NOTHING + SEP + self.observation()
        bought = self.bought is not None
        self.done = bought or self.steps >= self.max_steps
        info = {
            "won": self.won,
            "milestone": milestone is not None,
            "milestone_name": milestone,
            "admissible_commands": self.admissible_commands(),
        }
        if bought:
            info["score"] = reward
        return obs, reward, bought, (not bought) and self.steps >= self.max_steps, info

    # -- pages -------------------------------------------------------------------------------

    def _page_items(self) -> list[int]:
        s = self.page_no * self.page_size
        return self.results[s : s + self.page_size]

    def _more(self) -> bool:
        return (self.page_no + 1) * self.page_size < len(self.results)

    def observation(self) -> str:
        c = self.catalog
        if self.page == "search":
            return "search"
        if self.page == "done":
            pid, sc = self.bought
            return SEP.join(
                ["thank you for shopping with us!", "purchased", pid, "your score (min 0.0, max 1.0)", f"{sc:.2f}"]
            )
        parts = ["back to search"]
        if self.page == "results":
            if self.page_no > 0:
                parts.append("< prev")
            parts.append(f"page {self.page_no + 1} (total results: {len(self.results)})")
            if self._more():
                parts.append("next >")
            for i in self._page_items():
                p = c.products[i]
                parts += [p.pid, p.title, f"${p.price:.2f}"]
            if not self.results:
                parts.append("no results.")
            return SEP.join(parts)
        p = c.products[self.item]
        parts.append("< prev")
        if self.page == "description":
            return SEP.join(parts + [p.description])
        if self.page == "features":
            return SEP.join(parts + list(p.features))
        for name, values in c.options(p):
            parts += [name, *values]
        if self.selected:
            parts.append("selected: " + ", ".join(f"{k}: {v}" for k, v in self.selected.items()))
        parts += [p.title, f"price: ${p.price:.2f}", "rating: n.a.", "description", "features", "buy now"]
        return SEP.join(parts)

    def clickables(self) -> list[str]:
        c = self.catalog
        if self.page in ("search", "done"):
            return []
        out = ["back to search"]
        if self.page == "results":
            if self.page_no > 0:
                out.append("< prev")
            if self._more():
                out.append("next >")
            return out + [c.products[i].pid for i in self._page_items()]
        out.append("< prev")
        if self.page == "item":
            for _, values in c.options(c.products[self.item]):
                out += list(values)
            out += ["description", "features", "buy now"]
        return out

    def admissible_commands(self) -> list[str]:
        """verl-agent's list: `search[<your query>]` on the search page, else `click[...]` per button."""
        if self.page == "search":
            return [SEARCH]
        return [f"click[{b}]" for b in self.clickables()]

    # -- dynamics ----------------------------------------------------------------------------

    def _apply(self, cmd: str) -> tuple[float, str | None, bool]:
        """Run one command -> (reward, milestone or None, whether anything changed)."""
        if cmd.startswith("search[") and cmd.endswith("]") and self.page == "search":
            query = cmd[len("search[") : -1].strip()
            if not query:
                return 0.0, None, False
            self.results = self.catalog.search(query, self.num_results)
            self.page, self.page_no = "results", 0
            return 0.0, self._results_check(), True
        if not (cmd.startswith("click[") and cmd.endswith("]")):
            return 0.0, None, False
        button = cmd[len("click[") : -1].strip()
        if button not in self.clickables():
            return 0.0, None, False
        if button == "back to search":
            self.page, self.results, self.page_no, self.item = "search", [], 0, None
            return 0.0, None, True
        if self.page == "results":
            if button in ("next >", "< prev"):
                self.page_no += 1 if button == "next >" else -1
                return 0.0, self._results_check(), True
            self.item, self.page, self.selected = self.catalog.by_pid[button].index, "item", {}
            return 0.0, self._open_check(), True
        if button == "< prev":
            self.page = "results" if self.page == "item" else "item"
            return 0.0, (self._results_check() if self.page == "results" else None), True
        if button in ("description", "features"):
            self.page = button
            return 0.0, None, True
        p = self.catalog.products[self.item]
        if button == "buy now":
            sc, _ = score(self.catalog, p, self.goal, self.selected)
            self.won = sc >= 1.0
            self.bought, self.page = (p.pid, sc), "done"
            return float(sc), ("bought" if self.won else None), True
        for name, values in self.catalog.options(p):  # an option value (clickables are unique per page)
            if button in values:
                self.selected[name] = button
                return 0.0, self._option_check(name, button), True
        raise AssertionError(f"unhandled button {button!r}")  # clickables() and _apply disagree

    def _results_check(self) -> str | None:
        if self._seen_results or not any(i in self.winners for i in self._page_items()):
            return None
        self._seen_results = True
        return "results show a match"

    def _open_check(self) -> str | None:
        if self._opened or self.item not in self.winners:
            return None
        self._opened = True
        return f"opened {self.catalog.products[self.item].pid}"

    def _option_check(self, name: str, value: str) -> str | None:
        want = dict(self.goal.options).get(name)
        if self.item not in self.winners or value != want or name in self._options_done:
            return None
        self._options_done.add(name)
        return f"selected {name}: {value}"

    # -- expert ------------------------------------------------------------------------------

    def _plan(self) -> list[str]:
        return list(plan_for(self.catalog, self.goal, self.page_size, self.num_results))


@functools.lru_cache(maxsize=4096)
def plan_for(catalog: Catalog, g: Goal, page_size: int, num_results: int) -> tuple[str, ...]:
    """The expert's plan; () for a hand-built goal no product in its query's results can win."""
    results = catalog.search(g.query, num_results)
    found = expert_page(catalog, g, results, page_size)
    if found is None:
        return ()
    page, idx = found
    return tuple(
        [f"search[{g.query}]"]
        + ["click[next >]"] * page
        + [f"click[{catalog.products[idx].pid}]"]
        + [f"click[{v}]" for _, v in g.options]
        + ["click[buy now]"]
    )


def expert_plan(env: ShopEnv) -> list[str]:
    """The expert's plan for the env's current task, from its initial state."""
    if env.goal is None:
        raise EnvError("expert_plan() before reset()")
    return list(env.plan)


def expert_strategy(env: ShopEnv) -> str:
    """The expert's plan as the agent could know it before searching: the item is described by what
    the results page shows (type, attributes, price), not by an id it has not seen yet."""
    g = env.goal
    want = f"{g.type} that is {' and '.join(g.attributes)}"
    if g.price_upper < NO_BOUND:
        want += f", under {g.price_upper:.2f} dollars"
    if g.options:
        want += ", offering " + " and ".join(v for _, v in g.options)
    steps = [f"search[{g.query}]", f"click the first {want}"]
    steps += [f"click[{v}]" for _, v in g.options] + ["click[buy now]"]
    return ", then ".join(steps)


def solve(seed: int, **env_kwargs: Any) -> list[str]:
    """Expert plan for task `seed` of a ShopEnv built with `env_kwargs`."""
    env = ShopEnv(**env_kwargs)
    env.reset(seed=seed)
    return expert_plan(env)


__all__ = [
    "Goal",
    "ShopEnv",
    "can_win",
    "expert_plan",
    "expert_strategy",
    "generate",
    "make_goal",
    "price_upper",
    "score",
    "solve",
    "type_reward",
    "winners",
]
