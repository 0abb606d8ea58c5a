"""bench/learning.py: per-algorithm configs at equal trajectories, and the run summary."""

import argparse
import json
import pathlib

import pytest

from strata_jax.names import ALGOS
from tests.bench_modules import load_bench

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def learning():
    return load_bench("learning")


def _args(**kw):
    a = dict(
        iterations=4,
        sft_steps=10,
        horizon=(2, 6),
        eval_every=2,
        eval_tasks=8,
        progress=False,
        world="household",
        max_steps=0,
        sign_at=0,
        options=0,
        sft_tasks=0,
        set=[],
        revise_every=0,
        judge_samples=4,
        arms=list(ALGOS),
    )
    a.update(kw)
    return argparse.Namespace(**a)


def test_every_algorithm_gets_a_valid_config_with_equal_trajectories(learning):
    base = learning.base_config(_args())
    assert base.sft.styles == "both"
    for algo in learning.ALGOS:
        c = learning.run_config(base, algo, seed=3, model_path="/m")
        strata = algo.startswith("strata")
        per_task = c.algo.num_strategies * c.algo.traj_per_strategy if strata else c.algo.group_size
        assert per_task == 8 and c.algo.name == algo and c.seed == 3 and c.model.path == "/m"
        assert c.algo.judgment == strata and c.algo.diverse == strata  # household samples 2N candidates
        assert (c.env.horizon_min, c.env.horizon_max, c.iterations) == (2, 6, 4)


def test_doors_world_one_step_per_door_and_equal_trajectories(learning):
    """--world doors: the corridor with --horizon doors, max_steps = the most doors (a single wrong
    choice loses), 8 rows per door in a mini-batch, the doors check's own SFT steps unless given."""
    base = learning.base_config(_args(world="doors", horizon=(8, 8), sft_steps=None))
    assert base.env.name == "doors" and (base.env.horizon_min, base.env.horizon_max, base.env.max_steps) == (8, 8, 8)
    assert base.train.mini_batch_rows == 64 and base.sft.steps == 200 and base.sft.styles == "both"
    for algo in learning.ALGOS:
        c = learning.run_config(base, algo, seed=1, model_path="/m")
        per_task = c.algo.num_strategies * c.algo.traj_per_strategy if algo.startswith("strata") else c.algo.group_size
        assert per_task == 8 and c.env.name == "doors" and c.algo.name == algo
        assert not c.algo.diverse  # one candidate per slot: nothing to select, so selection is off
    assert learning.base_config(_args(world="doors", horizon=(4, 6), sft_steps=30)).sft.steps == 30
    # 96 held-out corridors are one policy call: a bucket for them is added (validate refused it)
    from configs.base import validate

    wide = learning.base_config(_args(world="doors", horizon=(2, 12), eval_tasks=96))
    assert max(wide.sampling.batch_buckets) == 96
    assert max(wide.sampling.prompt_buckets) == 1024  # a 12-step judge prompt (544 tokens) crashed at 512
    validate(learning.run_config(wide, "beacon", seed=0, model_path="/m"))


def test_revision_and_judgment_arms_differ_only_in_their_variant(learning):
    """--world signs with ':revise' / ':judge' arms: the warm start's config revises (its
    demonstrations then hold revision rows), each arm sets only its own variant."""
    arms = ["strata", "strata:revise", "strata:judge", "strata:judge-untrained", "grpo"]
    base = learning.base_config(
        _args(world="signs", horizon=(6, 6), sft_steps=None, sign_at=3, revise_every=3, arms=arms)
    )
    assert (base.env.name, base.env.doors_options, base.env.doors_sign_at, base.env.max_steps) == ("doors", 3, 3, 6)
    assert base.algo.revise_every == 3 and base.judge.samples == 4
    got = {a: learning.run_config(base, a, seed=2, model_path="/m") for a in arms}
    assert [(got[a].algo.revise_every, got[a].judge.samples, got[a].algo.judge_train) for a in arms] == [
        (0, 1, False),
        (3, 1, False),
        (0, 4, True),
        (0, 4, False),
        (0, 1, False),
    ]
    assert all(got[a].algo.name == a.partition(":")[0] and got[a].seed == 2 for a in arms)
    six = learning.base_config(_args(world="signs", horizon=(6, 6), sign_at=3, options=6, sft_tasks=512, arms=arms))
    assert (six.env.doors_options, six.env.doors_sign_at, six.sft.num_tasks) == (6, 3, 512)
    # no arm revises: the warm start's demonstrations do not either
    assert learning.base_config(_args(world="signs", horizon=(6, 6), sign_at=3, arms=["strata"])).algo.revise_every == 0
    # --max-steps gives retries in the corridor (the judge study), and the mini-batch follows the steps
    c = learning.base_config(_args(world="doors", horizon=(4, 4), max_steps=8, arms=["strata:judge"]))
    assert (c.env.max_steps, c.train.mini_batch_rows, c.env.doors_sign_at) == (8, 64, 0)
    # StraTA's ablation arms change only the candidates sampled, the selection and the judgment
    abl = ["strata", "strata:vanilla", "strata:diverse", "strata:full"]
    got = {
        a: learning.run_config(
            learning.base_config(_args(world="doors", horizon=(2, 12), arms=abl)), a, seed=0, model_path="/m"
        )
        for a in abl
    }
    assert [(got[a].algo.oversample, got[a].algo.diverse, got[a].algo.judgment) for a in abl] == [
        (1, False, True),
        (1, False, False),
        (4, True, False),
        (4, True, True),
    ]
    with pytest.raises(SystemExit, match="'grpo:vanilla': the variants are StraTA's"):
        learning.parse_arm("grpo:vanilla")
    for bad in ("strata:nope", "ppo", "grpo:"):
        if bad == "grpo:":
            assert learning.parse_arm(bad) == ("grpo", "")
            continue
        with pytest.raises(SystemExit, match="unknown entry"):
            learning.parse_arm(bad)


def test_summary_of_a_hand_written_history(learning, tmp_path):
    rows = [
        {"iteration": 0, "eval/success": 0.5, "eval/success_short": 1.0, "eval_greedy/success": 0.25},
        {
            "iteration": 1,
            "train/success": 0.1,
            "train/esu": 0.4,
            "train/car": 0.2,
            "train/invalid_rate": 0.3,
            "time/iteration_s": 10.0,
        },
        {
            "iteration": 2,
            "train/success": 0.3,
            "train/esu": 0.6,
            "train/car": 0.4,
            "train/invalid_rate": 0.1,
            "time/iteration_s": 20.0,
            "eval/success": 0.75,
            "eval/success_short": 0.5,
            "eval/success_long": 0.0,
            "eval/n_long": 2,
            "eval_greedy/success": 1.0,
        },
    ]
    s = learning.summarise(rows)
    assert (s["eval_start"], s["eval_end"], s["greedy_start"], s["greedy_end"]) == (0.5, 0.75, 0.25, 1.0)
    assert (s["train_success_first"], s["train_success_last"]) == (0.1, 0.3)
    assert s["esu"] == pytest.approx(0.5) and s["car"] == pytest.approx(0.3)
    assert s["invalid_rate"] == pytest.approx(0.2) and s["iteration_s"] == pytest.approx(15.0)
    assert (s["start_short"], s["end_short"], s["end_long"], s["n_long"], s["end_medium"]) == (1.0, 0.5, 0.0, 2, None)
    assert s["curve"] == [(0, 0.5), (2, 0.75)]
    assert s["train_curves"]["esu"] == [0.4, 0.6] and s["train_curves"]["car"] == [0.2, 0.4]
    assert s["train_curves"]["outcome_full"] == [None, None]  # not logged in these rows
    two = dict(s, train_curves=dict(s["train_curves"], outcome_full=[0.1, 0.3]))
    learning.training_diagnostics({"grpo/s0": two, "beacon/s0": s}, ["grpo", "beacon"], [0], tmp_path, "doors")
    assert (tmp_path / "training_diagnostics.png").stat().st_size > 0
    assert s["bucket_curves"]["short"] == [(0, 1.0), (2, 0.5)] and s["bucket_curves"]["long"] == [(0, None), (2, 0.0)]
    assert learning._bucket_at(s, "short", 2) == 0.5 and learning._bucket_at(s, "short", 0) == 1.0
    assert learning._bucket_at(s, "long", None) == 0.0 and learning._bucket_at(s, "medium", 2) is None
    learning.plots({"grpo/s0": s}, ["grpo"], [0], tmp_path, "doors")  # panels: iteration 2, the end
    assert (tmp_path / "success_by_horizon.png").stat().st_size > 0
    md = learning.table({"grpo/s0": s, "grpo/s1": dict(s, eval_end=0.25)}, ["grpo", "strata"], [0, 1])
    lines = md.splitlines()
    assert len(lines) == 3  # header, rule, one algorithm with results (strata has none)
    assert "| grpo | 0.500 ± 0.000 | 0.500 ± 0.250 |" in lines[2]
    assert s["judge_precision"] == [None, None] and "judge precision" not in md
    judged = dict(s, judge_precision=[0.5, 0.25], judge_recall=[0.1, 0.75])
    md = learning.table({"strata:judge/s0": judged, "strata/s0": s}, ["strata:judge", "strata"], [0])
    lines = md.splitlines()
    assert "judge precision (last) | judge recall (last) |" in lines[0]
    assert lines[2].endswith("| 0.250 | 0.750 |") and lines[3].endswith("| - | - |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    wd = tmp_path / "run"
    wd.mkdir()
    (wd / "metrics.jsonl").write_text("\n".join(__import__("json").dumps(r) for r in rows) + "\n")
    assert learning.finished(wd, 2) and not learning.finished(wd, 3)


def test_warmstart_figures_on_a_hand_batch(tmp_path):
    """Two tasks x 1 group of 4: task 0 (L* 3) has 2 wins of 4 (mixed), task 1 (L* 6) 0 of 4 (not
    mixed); first actions a, a, b, b (entropy ln 2) and c, c, c, <invalid> (entropy of 3:1)."""
    import json

    import numpy as np

    from bench.warmstart import figures

    P, N, M, H = 2, 1, 4, 3
    step = np.zeros((P, N, M, H), bool)
    step[..., :2] = True
    invalid = np.zeros_like(step)
    invalid[1, 0, 3, 0] = True
    won = np.zeros((P, N, M), bool)
    won[0, 0, :2] = True
    d = tmp_path / "batches"
    d.mkdir()
    np.savez(d / "iter_00001.npz", step_mask=step, invalid=invalid, won=won, horizon=np.array([3, 6]))
    acts = {(0, 0): ["a", "a", "b", "b"], (1, 0): ["c", "c", "c", ""]}
    trajs = [
        {"key": [p, n, m], "steps": [{"action": acts[(p, n)][m]}, {"action": "x"}]}
        for p in range(P)
        for n in range(N)
        for m in range(M)
    ]
    (d / "iter_00001.texts.json").write_text(json.dumps({"trajectories": trajs}))
    f = figures(tmp_path)
    assert f["invalid_rate"] == 1 / 16
    assert f["mixed_groups"] == 0.5 and f["mixed_short"] == 1.0 and f["mixed_medium"] == 0.0
    assert np.isnan(f["mixed_long"])
    want = (np.log(2) + -(0.75 * np.log(0.75) + 0.25 * np.log(0.25))) / 2
    assert abs(f["first_step_entropy"] - want) < 1e-12


@pytest.mark.slow
def test_revision_arm_runs_from_the_command_line(tmp_path):
    """The user's path: `bench/learning.py --world signs` with a ':revise' arm, through a subprocess
    (a 5-step warm start, one iteration). Every trajectory that reaches step sign_at is asked for a
    revision, and the results carry the arm's curve."""
    import json
    import subprocess
    import sys

    out = tmp_path / "signs"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "learning.py"),
        "--world",
        "signs",
        "--horizon",
        "3,3",
        "--sign-at",
        "1",
        "--algos",
        "strata:revise",
        "--seeds",
        "0",
        "--iterations",
        "1",
        "--eval-every",
        "1",
        "--eval-tasks",
        "4",
        "--sft-steps",
        "5",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| strata:revise |" in proc.stdout
    run = json.loads((out / "results.json").read_text())["runs"]["strata:revise/s0"]
    assert [i for i, _ in run["curve"]] == [0, 1]
    config = json.loads((out / "strata_revise_s0" / "config.json").read_text())
    assert (config["algo"]["revise_every"], config["env"]["doors_sign_at"], config["env"]["doors_options"]) == (1, 1, 3)
    texts = json.loads((out / "strata_revise_s0" / "batches" / "iter_00001.texts.json").read_text())
    revised = [t for t in texts["trajectories"] if t["revisions"]]
    # max_steps 3, K = 1: revisions before steps 1 and 2 of every trajectory (none ends early: 3 doors, 3 steps)
    assert len(revised) == len(texts["trajectories"]) > 0
    assert all([r["step"] for r in t["revisions"]] == [1, 2] for t in revised)


def test_default_gains_trains_what_a_bare_launch_runs(learning, tmp_path, monkeypatch):
    """`--default` measures README command 1: launch.py's DEFAULT_CONFIG per seed (it measured the
    household file by name while the default moved), and its line reports each seed's gain."""
    import json

    from rollout import trainer

    trained = []

    def fake_train(config, workdir):  # the figures of a run whose seed s gained 0.1 * (s + 1)
        trained.append((config.seed, config.env.name, config.env.doors_sign_at, config.algo.revise_every))
        g = 0.1 * (config.seed + 1)
        rows = [
            {"iteration": 0, "eval/success": 0.25, "eval_greedy/success": 0.25},
            {
                "iteration": config.iterations,
                "train/success": 0.5,
                "eval/success": 0.25 + g,
                "eval_greedy/success": 0.5,
            },
        ]
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    monkeypatch.setattr(trainer, "train", fake_train)
    out = learning.default_gains([0, 1], tmp_path, progress=False)
    assert trained == [(0, "doors", 3, 3), (1, "doors", 3, 3)]  # configs/tiny_signs.py, seeded
    assert [out["runs"][s]["gain"] for s in (0, 1)] == pytest.approx([0.1, 0.2])
    assert "+0.150 ± 0.050" in out["line"] and "min +0.100" in out["line"]
    assert json.loads((tmp_path / "default_gain.json").read_text())["mean"] == pytest.approx(0.15)
    assert out["runs"][1]["curve"] == [(0, 0.25), (24, pytest.approx(0.45))]  # the plot's line for seed 1
    assert (tmp_path / "default_eval_success.png").stat().st_size > 0
    learning.default_gains([0, 1], tmp_path, progress=False)  # finished runs are not trained again
    assert len(trained) == 2


def _config_dict(c):
    import json

    return json.loads(c.to_json())


def test_ablation_arms_differ_from_the_default_only_in_selection_and_judgment(learning):
    """--ablation: "+judgment" is the embedded default as it is (N strategies sampled, judged);
    the other arms change only algo.oversample / diverse / judgment and start from its SFT model."""
    default = learning._default_module()
    ref = _config_dict(learning.ablation_config(default, "+judgment", 2, "/m/sft_model"))
    plain = default.get_config()
    plain.seed = 2
    assert ref == _config_dict(plain)  # the default's own run, SFT included (no model.path)
    want = {"vanilla": (1, False, False), "+diverse": (4, True, False), "full": (4, True, True)}
    for arm, (oversample, diverse, judgment) in want.items():
        c = _config_dict(learning.ablation_config(default, arm, 2, "/m/sft_model"))
        assert (c["algo"]["oversample"], c["algo"]["diverse"], c["algo"]["judgment"]) == (oversample, diverse, judgment)
        assert c["model"]["path"] == "/m/sft_model"
        assert c["sft"]["steps"] == c["sft"]["read_steps"] == 0  # the default's SFT model is not warm-started again
        for k in ("oversample", "diverse", "judgment"):
            c["algo"][k] = ref["algo"][k]
        c["model"]["path"] = ""
        c["sft"]["steps"], c["sft"]["read_steps"] = ref["sft"]["steps"], ref["sft"]["read_steps"]
        assert c == ref, arm


def test_ablation_trains_three_arms_from_each_defaults_sft_model(learning, tmp_path, monkeypatch):
    """The study reuses `--default`'s run as the "+judgment" arm, trains the other three from its
    SFT model, tabulates the gains against vanilla's per seed, draws the figure and resumes."""
    import json

    from rollout import trainer

    trained = []
    gain = {"vanilla": 0.1, "+diverse": 0.15, "full": 0.3}

    def fake_train(config, workdir):
        arm = {(1, False): "vanilla", (4, False): "+diverse", (4, True): "full"}[
            (config.algo.oversample, config.algo.judgment)
        ]
        trained.append((arm, config.seed, config.model.path))
        g = gain[arm] + 0.01 * config.seed
        rows = [
            {"iteration": 0, "eval/success": 0.25},
            {"iteration": config.iterations, "train/success": 0.5, "eval/success": 0.25 + g},
        ]
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    for s in (0, 1):  # the finished --default runs: +0.2 each, SFT model on disk
        d = tmp_path / f"default_s{s}"
        (d / "sft_model").mkdir(parents=True)
        (d / "sft_model" / "config.json").write_text("{}")
        (d / "metrics.jsonl").write_text(
            json.dumps({"iteration": 0, "eval/success": 0.25})
            + "\n"
            + json.dumps({"iteration": 24, "train/success": 0.5, "eval/success": 0.45})
            + "\n"
        )
    monkeypatch.setattr(trainer, "train", fake_train)
    out = learning.ablation([0, 1], tmp_path, progress=False)
    assert sorted(trained) == sorted(
        (a, s, str(tmp_path / f"default_s{s}" / "sft_model")) for s in (0, 1) for a in ("vanilla", "+diverse", "full")
    )
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in out["table"].splitlines()[2:]}
    assert list(lines) == ["vanilla", "+diverse", "+judgment", "full"]
    assert "0.355 ± 0.005 | 0.105 ± 0.005 | +0.000, +0.000" in lines["vanilla"]
    assert "| 0.450 ± 0.000 | 0.200 ± 0.000 | +0.100, +0.090 |" in lines["+judgment"]
    assert "| +0.200, +0.200 |" in lines["full"]
    assert (tmp_path / "strata_ablation.png").stat().st_size > 0
    assert json.loads((tmp_path / "ablation.json").read_text())["seeds"] == [0, 1]
    learning.ablation([0, 1], tmp_path, progress=False)  # finished runs are not trained again
    assert len(trained) == 6
    (tmp_path / "default_s1" / "sft_model" / "config.json").unlink()
    (tmp_path / "ablation_vanilla_s1" / "metrics.jsonl").unlink()
    with pytest.raises(SystemExit, match="default_s1: the default's run"):
        learning.ablation([0, 1], tmp_path, progress=False)


def test_smol_study_config_keeps_the_algorithm_and_sets_its_levers(learning):
    """--world smol: configs/smol_household.py with the study's horizon, demonstrations in both
    prompt styles, LoRA and no KL term; each arm equal trajectories per task (flat G = N x M)."""
    args = _args(world="smol", tasks=4, lora_rank=16, lr=5e-5, eval_tasks=64, sft_steps=None, horizon=(2, 8))
    base = learning.smol_base(args)
    assert base.model.path == "smollm2" and base.sft.styles == "both"
    assert (base.env.horizon_min, base.env.horizon_max) == (2, 8) and base.env.max_steps >= 16
    assert base.model.lora_rank == 16 and base.train.kl_coef == 0.0 and base.sampling.prefix_cache
    assert base.algo.tasks_per_iter == 4 and base.eval.num_tasks == 64
    for arm in ("grpo", "beacon", "strata"):
        c = learning.run_config(base, arm, 0, "/tmp/sft_model")
        assert c.algo.name == arm and c.model.path == "/tmp/sft_model" and c.sft.steps == 0
        per_task = c.algo.group_size if arm != "strata" else c.algo.num_strategies * c.algo.traj_per_strategy
        assert per_task == base.algo.num_strategies * base.algo.traj_per_strategy
        # Its ALFWorld evaluation runs the arm's own algorithm (prompts with a strategy or without).
        alf = learning.smol_alfworld_config(c, "/tmp/sft_model", 32)
        assert alf.algo.name == arm and alf.algo.judgment == (arm == "strata")
        assert alf.env.name == "alfworld" and alf.env.eval_split == "valid_unseen" and alf.eval.num_tasks == 32
        assert alf.env.max_steps == 20 and alf.algo.milestones == "facts"
        assert alf.model.lora_rank == 16  # the arm's adapters restore onto the same model


def test_smol_results_are_per_seed_per_arm_task_outcomes(learning):
    """results.json's schema by hand: one entry per seed, each arm's start and final outcome per
    task (None for an episode masked out), the start shared by the arms of one prompt style."""
    flat = {"tasks": [7, 8, 9], "won": [1, 0, 0], "valid": [1, 1, 0], "horizon": [2, 5, 9]}
    final = {"tasks": [7, 8, 9], "won": [1, 1, 0], "valid": [1, 1, 1], "horizon": [2, 5, 9]}
    starts = {("grpo", "household"): flat}
    finals = {("grpo", 0, "household"): final, ("grpo", 1, "household"): flat}
    out = learning.smol_results(starts, finals, ["grpo"], [0, 1])
    assert [e["seed"] for e in out] == [0, 1]
    assert out[0]["arms"]["grpo"]["household"] == {"start": [1, 0, None], "final": [1, 1, 0], "tasks": [7, 8, 9]}
    assert out[1]["arms"]["grpo"]["household"]["final"] == [1, 0, None]
    assert "alfworld" not in out[0]["arms"]["grpo"]
    assert learning._rate(final) == 2 / 3 and learning._rate(flat) == 1 / 2
    # horizon buckets as the evaluation reports them: short L* <= 4, medium 5-7, long >= 8
    assert learning._bucket_rates(final) == {
        "eval/success_short": 1.0,
        "eval/n_short": 1,
        "eval/success_medium": 1.0,
        "eval/n_medium": 1,
        "eval/success_long": 0.0,
        "eval/n_long": 1,
    }


def test_paired_gain_by_hand(learning):
    """Final minus start over the tasks valid at both ends, its standard error, the flips."""
    g = learning.paired_gain([1, 0, 0, None, 1, 0], [1, 1, 1, 1, 0, None])
    # tasks 0-2 and 4 pair up: differences 0, +1, +1, -1 -> mean 0.25, sd (ddof 1) 0.9574
    assert g["tasks"] == 4 and g["lost_won"] == 2 and g["won_lost"] == 1
    assert g["gain"] == pytest.approx(0.25)
    assert g["se"] == pytest.approx((((0.25**2) + 2 * 0.75**2 + 1.25**2) / 3) ** 0.5 / 2)
    entries = [
        {
            "seed": 0,
            "arms": {
                "grpo": {
                    "household": {
                        "start": [1, 0, 0, None, 1, 0],
                        "final": [1, 1, 1, 1, 0, None],
                        "tasks": list(range(6)),
                    }
                }
            },
        }
    ]
    row = learning.gain_table(entries).splitlines()[2]
    # start 2 of 5 valid, final 4 of 5 valid; the gain is over the 4 paired tasks
    assert row == "| grpo | 0 | household | 4 | 0.400 | 0.800 | +0.250 ± 0.957 | 2 | 1 |"


def test_smol_report_writes_what_is_finished_and_nothing_else(learning, tmp_path):
    """--report on a study stopped mid-way (hand-written outputs): the finished arm's per-task
    outcomes go to results.json, the arm still training is left out, nothing is run."""

    def write(path, outcome, iteration=2):
        path.mkdir(parents=True, exist_ok=True)
        (path / f"iter_{iteration:05d}.json").write_text(json.dumps({"eval": outcome}))

    tasks = {"tasks": [3, 4, 5], "horizon": [2, 6, 9], "temperature": 0.4}
    start = {**tasks, "won": [1, 0, 0], "valid": [1, 1, 1]}
    final = {**tasks, "won": [1, 1, 0], "valid": [1, 1, 1]}
    for style in ("grpo", "strata"):
        for world in ("household", "alfworld"):
            write(tmp_path / f"start_{style}_{world}" / "evals", start, iteration=0)
    run = tmp_path / "grpo_s0"
    write(run / "evals", final)
    write(run / "alfworld" / "evals", start)
    rows = [
        {"iteration": 1, "train/success": 0.25, "train/esu": 0.5, "time/iteration_s": 10.0},
        {"iteration": 2, "train/success": 0.5, "train/esu": 0.4, "time/iteration_s": 12.0, "eval/success": 2 / 3},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "strata_s0").mkdir()  # started, not finished
    args = _args(
        world="smol", algos="grpo,strata", seeds="0", iterations=2, eval_every=2, eval_tasks=3, tasks=4,
        lora_rank=16, lr=5e-5, sft_steps=None, horizon=(2, 8), alfworld_tasks=3, out=str(tmp_path),
        results=None, sft_only=False, report=True,
    )  # fmt: skip
    learning.smol_study(args)
    entries = json.loads((tmp_path / "results.json").read_text())
    assert entries == [
        {
            "seed": 0,
            "arms": {
                "grpo": {
                    "household": {"start": [1, 0, 0], "final": [1, 1, 0], "tasks": [3, 4, 5]},
                    "alfworld": {"start": [1, 0, 0], "final": [1, 0, 0], "tasks": [3, 4, 5]},
                }
            },
        }
    ]
    md = (tmp_path / "results.md").read_text()
    assert "| grpo | 0 | household | 3 | 0.333 | 0.667 | +0.333 ± 0.667 | 1 | 0 |" in md
    assert "strata" not in md
    assert (tmp_path / "eval_success.png").exists()
    assert not (tmp_path / "shared").exists() and not (tmp_path / "strata_s0" / "metrics.jsonl").exists()
