"""The offline WebShop-style store: catalogue, search, reward by hand, expert, milestones, no-ops.

Independent references: the reward cases are computed by hand from WebShop's formula; the search
scores against a plain-Python Lucene BM25; the expert's plan length against a breadth-first search
over the store's states; the end-to-end runs go through `launch.py` as a user types it.
"""

import collections
import dataclasses
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from rollout.collect import RolloutConfig, collect
from rollout.envs import INTROS, make_env
from rollout.envs.base import EnvError
from rollout.envs.shop import (
    NOTHING,
    SEARCH,
    ShopEnv,
    can_win,
    expert_plan,
    expert_strategy,
    generate,
    make_goal,
    score,
    type_reward,
)
from rollout.envs.shop_catalog import Catalog, get_catalog
from rollout.parsing import parse_action
from rollout.policy import ScriptedPolicy

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return get_catalog(0, 24000)


def play(env, actions):
    return [env.step(a) for a in actions]


# ----------------------------------------------------------------------------- catalogue, search


def test_catalogue_size_overlap_hard_negatives_and_determinism(catalog):
    assert len(catalog.products) >= 10_000 and len(catalog.categories) >= 100
    assert len({p.pid for p in catalog.products}) == len(catalog.products)
    assert all(re.fullmatch(r"b0[0-9a-z]{8}", p.pid) for p in catalog.products[:500])
    # overlapping titles: type words shared between categories ("running", "table", "coffee", ...)
    words = collections.Counter(w for c in catalog.categories for w in set(c.type.split()))
    assert sum(n > 1 for n in words.values()) >= 20
    # hard negatives: a product of the same category and brand that misses exactly one attribute
    by_key = collections.defaultdict(list)
    for p in catalog.products:
        by_key[(p.category, p.brand)].append(p)
    near = sum(
        any(
            len(p.attributes ^ q.attributes) == 2 and len(p.attributes) == len(q.attributes)
            for q in by_key[(p.category, p.brand)]
        )
        for p in catalog.products
    )
    assert near / len(catalog.products) > 0.3
    # every attribute of a product is spelled in its title, and only its own attributes are
    for p in catalog.products[:2000]:
        assert set(p.title.split(", ")[1:]) == p.attributes
    # deterministic in the seed (the uncached builder, twice), different across seeds
    build = get_catalog.__wrapped__
    a, b, c = build(3, 2000), build(3, 2000), build(4, 2000)
    key = lambda cat: [(p.pid, p.title, p.price, p.options) for p in cat.products]  # noqa: E731
    assert key(a) == key(b) and key(a) != key(c)
    assert a.search("non slip running shoes", 20) == b.search("non slip running shoes", 20)


def _group_attrs(category):
    from rollout.envs.shop_catalog import GROUPS

    return GROUPS[category.department][category.group][1]


STOPWORDS = None


def _tokens(text):
    """bm25s's default analysis, written out: lowercase, words of 2+ word characters, no English stopwords."""
    global STOPWORDS
    if STOPWORDS is None:
        from bm25s.stopwords import STOPWORDS_EN

        STOPWORDS = set(STOPWORDS_EN)
    return [w for w in re.findall(r"(?u)\b\w\w+\b", text.lower()) if w not in STOPWORDS]


def test_bm25_scores_equal_a_plain_lucene_bm25(catalog):
    docs = [_tokens(Catalog.document(p)) for p in catalog.products]
    n, avgdl = len(docs), sum(map(len, docs)) / len(docs)
    df = collections.Counter(w for d in docs for w in set(d))
    k1, b = 1.5, 0.75
    for query in ("non slip running shoes", "organic green tea", "solid wood coffee table", "4k hdmi cable"):
        q = _tokens(query)
        ref = np.zeros(n)
        for i, d in enumerate(docs):
            tf = collections.Counter(d)
            for w in q:
                if tf[w]:
                    idf = math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5))
                    ref[i] += idf * tf[w] / (tf[w] + k1 * (1 - b + b * len(d) / avgdl))
        ids = [
            t
            for t in catalog._tokenizer.tokenize([query], update_vocab=False, show_progress=False, return_as="ids")[0]
            if t != 0
        ]
        got = catalog._bm25.get_scores(ids)
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-6)
        # search = the 50 best by score, ties by catalogue position (a full stable sort)
        top = [int(i) for i in np.argsort(-got, kind="stable")[:50] if got[i] > 0]
        assert catalog.search(query, 50) == top
    assert catalog.search("the and of", 50) == [] and catalog.search("zzzqqq", 50) == []


# ----------------------------------------------------------------------------- reward by hand


def _shoe(catalog, n_attrs=3):
    """A shoe listing with n attributes and every option (color, size, width) offering 2+ values."""
    for p in catalog.products:
        c = catalog.categories[p.category]
        if (
            c.type == "running shoes"
            and len(p.attributes) == n_attrs
            and len(p.options) == 3
            and all(len(v) >= 2 for _, v in p.options)
        ):
            return p
    raise AssertionError("no such shoe")


def _find(catalog, type_, pred=lambda p: True):
    return next(p for p in catalog.products if catalog.categories[p.category].type == type_ and pred(p))


def test_reward_hand_cases(catalog):
    p = _shoe(catalog)
    a1, a2, a3 = sorted(p.attributes)
    (_, colors), (_, sizes), (_, widths) = p.options
    upper = (math.floor(p.price / 10) + 2) * 10.0  # a multiple of ten above the price
    g = make_goal(catalog, p, [a1, a2], [("color", colors[0]), ("size", sizes[0])], upper)
    assert g.instruction == (
        f"i need {a1} and {a2} running shoes, with color: {colors[0]}, and size: "
        f"{sizes[0]}, and price lower than {upper:.2f} dollars"
    )
    assert g.query == f"{a1} and {a2} running shoes"
    full = {"color": colors[0], "size": sizes[0], "width": widths[0]}  # an extra option costs nothing
    assert score(catalog, p, g, full)[0] == 1.0 and can_win(catalog, p, g)
    # (2 attributes + 1 option + price) / (2 + 2 + 1)
    assert score(catalog, p, g, {"color": colors[0]})[0] == pytest.approx(4 / 5)
    assert score(catalog, p, g, {"color": colors[1], "size": sizes[0]})[0] == pytest.approx(4 / 5)
    assert score(catalog, p, g, {})[0] == pytest.approx(3 / 5)
    # price over the bound: (2 + 2 + 0) / 5
    cheap = dataclasses.replace(g, price_upper=math.floor(p.price) - 10.0)
    assert score(catalog, p, cheap, full)[0] == pytest.approx(4 / 5) and not can_win(catalog, p, cheap)
    # a goal attribute the product lacks: (1 + 2 + 1) / 5
    other = next(a for a in _group_attrs(catalog.categories[p.category]) if a not in p.attributes)
    g_other = make_goal(catalog, p, [a1, other], list(g.options), upper)
    assert score(catalog, p, g_other, full)[0] == pytest.approx(4 / 5)
    # wrong type, no shared word and another department: r_type 0, whatever else matches
    tea = _find(catalog, "green tea")
    assert type_reward(catalog, tea, g) == 0.0 and score(catalog, tea, g, full)[0] == 0.0
    # same group, no shared type word: WebShop zeroes r_type when title_score == 0
    assert type_reward(catalog, _find(catalog, "sandals"), g) == 0.0
    # same group and a shared word ("trail running shoes"), or a shared word across groups
    # ("running shorts": title_score 1/2 > 0.2): r_type 1
    assert type_reward(catalog, _find(catalog, "trail running shoes"), g) == 1.0
    assert type_reward(catalog, _find(catalog, "running shorts"), g) == 1.0
    # title_score exactly 0.2 (1 of 5 words), no category match: 0.5; 1 of 11 words (< 0.1): 0.1
    far = ("food", "snacks", "x")
    g5 = dataclasses.replace(g, category=-1, path=far, type="alpha beta gamma delta shoes")
    assert type_reward(catalog, p, g5) == 0.5
    assert score(catalog, p, g5, full)[0] == pytest.approx(0.5)
    g11 = dataclasses.replace(g5, type="a1 a2 a3 a4 a5 a6 a7 a8 a9 a10 shoes")
    assert type_reward(catalog, p, g11) == 0.1


def test_buying_short_of_the_goal_scores_partially_and_ends_the_episode():
    env = ShopEnv()
    for seed in range(200):
        _, info = env.reset(seed=seed)
        if len(env.goal.options) >= 2:
            break
    g, plan = env.goal, expert_plan(env)
    k, a = len(g.options), len(g.attributes)
    skip = f"click[{g.options[0][1]}]"
    *_, (obs, r, term, trunc, info) = play(env, [x for x in plan if x != skip])
    assert r == pytest.approx((a + (k - 1) + 1) / (a + k + 1)) == info["score"]
    assert term and not trunc and not info["won"] and not info["milestone"]
    assert obs.startswith("thank you for shopping with us!") and f"{r:.2f}" in obs
    assert info["admissible_commands"] == []
    with pytest.raises(EnvError, match="after the episode ended"):
        env.step("click[buy now]")


# ----------------------------------------------------------------------------- expert, horizon, milestones


@pytest.mark.parametrize("kw, n", [({}, 45), ({"page_size": 5, "horizon": (3, 8)}, 30)])
def test_expert_wins_at_exactly_its_horizon_with_milestones_in_order(kw, n):
    env = ShopEnv(**kw)
    lo, hi = env.horizon
    lengths, types = collections.Counter(), collections.Counter()
    for seed in range(n):
        _, info = env.reset(seed=seed)
        plan, g = expert_plan(env), env.goal
        L = len(plan)
        assert L == info["horizon"] and lo <= L <= hi and info["task"] == g.instruction
        assert info["milestones_total"] == 2 + len(g.options) + 1
        flags, names = [], []
        for i, action in enumerate(plan):
            pa = parse_action(f"<think>x</think><action>{action}</action>", info["admissible_commands"])
            assert pa.valid and pa.action == action, (seed, action, info["admissible_commands"])
            _, r, term, trunc, info = env.step(action)
            last = i == L - 1
            assert term == info["won"] == last and not trunc and r == (1.0 if last else 0.0)
            flags.append(info["milestone"])
            if info["milestone"]:
                names.append(info["milestone_name"])
        page = plan.count("click[next >]")
        # the results page holding the first winner, then every remaining step is a milestone
        assert flags == [i >= page for i in range(L)], (seed, plan)
        pid = plan[page + 1][len("click[") : -1]
        assert names == (
            ["results show a match", f"opened {pid}"] + [f"selected {k}: {v}" for k, v in g.options] + ["bought"]
        )
        lengths[L] += 1
        types[g.department] += 1
    assert set(lengths) == set(range(lo, hi + 1)), lengths
    assert len(types) >= 4


def _snapshot(env):
    return (env.page, tuple(env.results), env.page_no, env.item, tuple(sorted(env.selected.items())))


def _restore(env, snap):
    env.page, results, env.page_no, env.item, selected = snap
    env.results, env.selected = list(results), dict(selected)
    env.done, env.bought, env.won = False, None, False


def _bfs_length(env, query, limit):
    """Fewest actions from the start to a purchase scoring 1, searching only `query`."""
    start = _snapshot(env)
    frontier, seen = [start], {start}
    for depth in range(1, limit + 1):
        nxt = []
        for snap in frontier:
            _restore(env, snap)
            cmds = [f"search[{query}]" if c == SEARCH else c for c in env.admissible_commands()]
            for c in cmds:
                _restore(env, snap)
                reward, _, changed = env._apply(c)
                if c == "click[buy now]":
                    if reward == 1.0:
                        return depth
                    continue
                s = _snapshot(env)
                if changed and s not in seen:
                    seen.add(s)
                    nxt.append(s)
        frontier = nxt
    return None


def test_expert_plan_is_shortest_for_the_instruction_query():
    env = ShopEnv(page_size=5, horizon=(3, 8))
    for seed in range(12):
        env.reset(seed=seed)
        plan = expert_plan(env)
        assert _bfs_length(env, env.goal.query, len(plan)) == len(plan), seed


def test_horizon_range_and_determinism():
    for lo, hi in [(3, 3), (5, 6), (8, 9)]:
        env = ShopEnv(horizon=(lo, hi))
        seen = {env.reset(seed=s)[1]["horizon"] for s in range(12)}
        assert seen == set(range(lo, hi + 1))
    a, b = ShopEnv(), ShopEnv()
    oa, ia = a.reset(seed=11)
    a.step("search[shoes]")
    ob, ib = b.reset(seed=11)
    assert (oa, ia) == (ob, ib) == a.reset(seed=11)
    assert len({ShopEnv().reset(seed=s)[1]["task"] for s in range(20)}) == 20
    with pytest.raises(ValueError, match="no shop task has a plan length"):
        ShopEnv(horizon=(11, 12))
    with pytest.raises(ValueError, match="horizon must be"):
        ShopEnv(horizon=(5, 4))


def test_retrieval_ranks_the_expert_pick_on_the_planned_page(catalog):
    for seed in range(20):
        goal, page, idx = generate(seed, 3, 9, 0, 24000, 10, 50)
        results = catalog.search(goal.query, 50)
        assert results.index(idx) // 10 == page
        assert can_win(catalog, catalog.products[idx], goal)
        assert not any(can_win(catalog, catalog.products[i], goal) for i in results[: page * 10])


# ----------------------------------------------------------------------------- pages and no-ops


def test_pages_pagination_options_and_navigation(catalog):
    env = ShopEnv(max_steps=40)
    obs, info = env.reset(seed=2)
    assert obs == "search" and info["admissible_commands"] == [SEARCH]
    obs, *_, info = env.step("search[running shoes]")
    res = catalog.search("running shoes", 50)
    assert len(res) == 50 and "page 1 (total results: 50)" in obs
    assert info["admissible_commands"] == (
        ["click[back to search]", "click[next >]"] + [f"click[{catalog.products[i].pid}]" for i in res[:10]]
    )
    first = catalog.products[res[0]]
    assert obs.split(" [SEP] ")[3:6] == [first.pid, first.title, f"${first.price:.2f}"]
    for page in range(2, 6):
        obs, *_, info = env.step("click[next >]")
        assert f"page {page} (total results: 50)" in obs and "click[< prev]" in info["admissible_commands"]
        assert [c[6:-1] for c in info["admissible_commands"] if c.startswith("click[b0")] == [
            catalog.products[i].pid for i in res[(page - 1) * 10 : page * 10]
        ]
    assert "click[next >]" not in info["admissible_commands"]
    assert env.step("click[next >]")[0].startswith(NOTHING)  # no page 6
    obs, *_, info = env.step("click[< prev]")
    assert "page 4 " in obs
    p = next(catalog.products[i] for i in res[30:40] if any(len(v) >= 2 for _, v in catalog.products[i].options))
    pid = p.pid
    obs, *_, info = env.step(f"click[{pid}]")
    values = [v for _, vs in p.options for v in vs]
    assert info["admissible_commands"] == (
        ["click[back to search]", "click[< prev]"]
        + [f"click[{v}]" for v in values]
        + ["click[description]", "click[features]", "click[buy now]"]
    )
    assert p.title in obs and f"price: ${p.price:.2f}" in obs
    name, vals = next((n, v) for n, v in p.options if len(v) >= 2)
    env.step(f"click[{vals[0]}]")
    obs, *_ = env.step(f"click[{vals[1]}]")  # a second value of an option replaces the first
    assert env.selected == {name: vals[1]} and f"selected: {name}: {vals[1]}" in obs
    obs, *_, info = env.step("click[features]")
    assert obs == " [SEP] ".join(["back to search", "< prev", *p.features])
    assert info["admissible_commands"] == ["click[back to search]", "click[< prev]"]
    env.step("click[< prev]")
    obs, *_ = env.step("click[description]")
    assert obs.endswith(p.description)
    env.step("click[< prev]")
    obs, *_ = env.step("click[< prev]")  # item -> the results page it was opened from
    assert "page 4 " in obs
    env.step(f"click[{pid}]")
    assert env.selected == {}  # opening an item clears the options
    obs, *_, info = env.step("click[back to search]")
    assert obs == "search" and info["admissible_commands"] == [SEARCH]
    obs, *_, info = env.step("search[zzzqqq]")
    assert "no results." in obs and info["admissible_commands"] == ["click[back to search]"]


def test_search_template_in_the_admissible_list():
    ok = parse_action("<action>Search[ Red  Shoes ]</action>", [SEARCH])
    assert ok.valid and ok.action == "search[ red shoes ]"
    for text in (
        "<action>search[]</action>",
        "<action>search[  ]</action>",
        "<action>searching[x]</action>",
        "<action>click[x]</action>",
    ):
        assert parse_action(text, [SEARCH]).reason == "inadmissible", text
    assert not parse_action("<action>search[x]</action>", ["click[back to search]"]).valid


def test_malformed_and_inadmissible_actions_are_counted_noops():
    env = ShopEnv(max_steps=14)
    env.reset(seed=4)
    bad_on_search = ["", "click[buy now]", "search[]", "search[   ]", "search", "jump", "click[next >]"]
    for i, a in enumerate(bad_on_search, 1):
        before = _snapshot(env)
        obs, r, term, trunc, info = env.step(a)
        assert obs == NOTHING + " [SEP] search" and r == 0.0 and not term and not trunc
        assert _snapshot(env) == before and info["admissible_commands"] == [SEARCH] and not info["milestone"]
        assert env.noops == i and env.steps == i
    env.step(f"search[{env.goal.query}]")
    before = _snapshot(env)
    page = env.observation()
    for a in ["search[shoes]", "click[b0zzzzzzzz]", "click[description]", "click[ next > ", "click[]"]:
        obs, r, *_ = env.step(a)
        assert obs == NOTHING + " [SEP] " + page and _snapshot(env) == before
    assert env.noops == len(bad_on_search) + 5 and env.steps == env.noops + 1
    *_, trunc, _ = env.step("")
    assert trunc  # the 14th step
    with pytest.raises(EnvError, match="after the episode ended"):
        env.step("")
    env.reset(seed=0)
    with pytest.raises(TypeError):
        env.step(None)
    with pytest.raises(EnvError, match="before reset"):
        ShopEnv().step("")


def test_collect_counts_invalid_outputs_and_gives_partial_credit():
    """Three agents per task: the expert, one whose every output is invalid, one that buys the
    expert's product without choosing options. R = r_succ * won + score."""
    env = ShopEnv()
    seeds = [s for s in range(50) if env.reset(seed=s) and env.goal.options][:2]  # tasks with options
    plans, goals = {}, {}
    for p, s in enumerate(seeds):
        env.reset(seed=s)
        plans[p], goals[p] = expert_plan(env), env.goal
    rude = {p: [a for a in plans[p] if a[len("click[") : -1] not in {v for _, v in goals[p].options}] for p in plans}

    def script(msgs, kind, key):
        if kind == "judge":
            return "<bad_steps>none</bad_steps>"
        p, n, m, t = key
        if m == 1:
            return ["<action>fly</action>", "no tags at all", "<action></action>"][t % 3]
        return f"<think>x</think><action>{(plans if m == 0 else rude)[p][t]}</action>"

    cfg = RolloutConfig(
        mode="flat",
        group_size=3,
        max_steps=15,
        judgment=False,
        progress=False,
        row_multiple=8,
        env_reward_in_return=True,
    )
    res = collect([ShopEnv() for _ in range(6)], ScriptedPolicy(script), seeds, cfg)
    b = res.traj
    for p in range(2):
        k, a = len(goals[p].options), len(goals[p].attributes)
        assert np.asarray(b.won[p, 0]).tolist() == [True, False, False]
        want = [10.0 + 1.0, 0.0, 10.0 * 0 + (a + 0 + 1) / (a + k + 1)]
        np.testing.assert_allclose(np.asarray(b.episode_return[p, 0]), want, rtol=1e-6)
        assert np.asarray(b.step_mask[p, 0, 1]).sum() == 15 and np.asarray(b.invalid[p, 0, 1]).all()
        anchors = np.asarray(b.anchor_id[p, 0, 1])
        assert len(set(anchors[1:].tolist())) == 1  # the invalid agent never leaves its page
        assert int(b.horizon[p]) == len(plans[p])
        assert np.asarray(b.milestone[p, 0, 0]).sum() == 2 + k + 1
    assert res.stats["invalid"] == 30
    assert res.stats["invalid/inadmissible"] == 10 and res.stats["invalid/missing_tag"] == 10
    assert res.stats["invalid/empty"] == 10


# ----------------------------------------------------------------------------- plumbing


def test_registry_config_prompts_and_demos():
    from configs.base import base_config, validate, with_algo_env
    from rollout.demos import corpus, expert_env_kwargs, shop_expert

    c = validate(with_algo_env(base_config(), "strata", "shop"))
    assert c.env.max_steps == 15
    env = make_env("shop", **expert_env_kwargs(c))
    assert isinstance(env, ShopEnv) and env.max_steps == 15 and env.horizon == (3, 9)
    cfg = RolloutConfig.from_config(c)
    assert cfg.env_reward_in_return and cfg.intro == INTROS["shop"]
    assert not RolloutConfig.from_config(with_algo_env(base_config(), "strata", "household")).env_reward_in_return
    # the expert's strategy names the item by what the results show, never by an id
    plan, strategy = shop_expert(7, expert_env_kwargs(c))
    env.reset(seed=7)
    assert plan == expert_plan(env) and strategy == expert_strategy(env)
    assert strategy.startswith(f"search[{env.goal.query}], then click the first {env.goal.type}")
    assert not re.search(r"\bb0[0-9a-z]{8}\b", strategy)
    c.log.progress = False
    texts = corpus(c, num_tasks=4)
    assert any(INTROS["shop"] in t for t in texts) and any("<strategy>search[" in t for t in texts)


def _launch(*args, timeout=900):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the CLI runs on the plain CPU device, as a user would
    r = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env=env,
    )
    if r.returncode != 0:
        raise AssertionError(f"launch.py {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return r


SMALL = [
    "--config.algo.tasks_per_iter=2",
    "--config.algo.num_strategies=2",
    "--config.algo.traj_per_strategy=2",
    "--config.algo.oversample=2",
    "--config.algo.group_size=4",
    "--config.env.max_steps=5",
    "--config.env.horizon_min=3",
    "--config.env.horizon_max=5",
    "--config.eval.every=0",
    "--config.train.mini_batch_rows=16",
    "--config.sampling.max_action_tokens=12",
    "--config.sampling.max_strategy_tokens=16",
    "--config.sampling.max_judge_tokens=8",
    "--config.log.progress=False",
    "--config.iterations=1",
    "--config.checkpoint.every=0",
    "--config.log.plots_every=0",
    "--config.log.save_batches=False",
]
TINY = [
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


@pytest.mark.slow
def test_strata_and_beacon_iterate_on_shop_through_launch(tmp_path):
    """StraTA builds the tiny model (shop tokenizer, 3 SFT steps on shop demos) and runs one
    iteration; BEACON starts from that SFT model and runs one."""
    config = ["--config", str(REPO / "configs" / "tiny_shop.py")]
    runs = {"strata": tmp_path / "strata", "beacon": tmp_path / "beacon"}
    _launch(*config, *TINY, *SMALL, "--workdir", str(runs["strata"]))
    sft = runs["strata"] / "sft_model"
    info = json.loads((sft / "sft_info.json").read_text())
    assert info["steps"] == 3 and info["rows"] > 8
    _launch(
        *config,
        *SMALL,
        "--config.algo.name=beacon",
        "--config.algo.judgment=False",
        "--config.algo.diverse=False",
        f"--config.model.path={sft}",
        "--config.sft.steps=0",
        "--config.sft.read_steps=0",
        "--workdir",
        str(runs["beacon"]),
    )
    for name, work in runs.items():
        rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
        last = rows[-1]
        assert last["iteration"] == 1 and np.isfinite(last["update/loss"]) and last["update/steps"] >= 1
        assert last["train/num_trajectories"] == 8  # StraTA 2 x 2 x 2, BEACON 2 x 4
        assert 0.0 <= last["train/success"] <= 1.0
        cfg = json.loads((work / "config.json").read_text())
        assert cfg["env"]["name"] == "shop" and cfg["algo"]["name"] == name
