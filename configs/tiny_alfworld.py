"""The tiny pipeline on REAL ALFWorld games, sized for a CPU (2 cores, ~20 minutes).

StraTA with the tiny model of `configs/tiny_household.py`: with `model.path` empty the trainer builds
the tiny model (tokenizer trained on household expert texts) and warm-starts it by SFT on household
expert demonstrations, whose commands, wording and prompt layout are ALFWorld's. It then trains on
real ALFWorld games through the TextWorld engine, with facts-based milestones.

Games: unpack the shared archive into `env.data_dir` (never into git; `/data/` is ignored):

    mkdir -p data/alfworld && tar xJf ../shared/data/alfworld/eval.tar.xz -C data/alfworld
    python launch.py train --config configs/tiny_alfworld.py --workdir runs/tiny_alfworld

Training uses `valid_seen` (140 games) and evaluation `valid_unseen` (134), both in eval.tar.xz
(25 MB unpacked). For the published setup train on `train` (3553 games: also unpack
train.tar.xz, 5.6 MB -> 317 MB, ~7000 files) with `--config.env.split=train`.

Sizes: P=4 tasks x N=2 strategies x M=2 trajectories = 16 environments in this process, 15 steps.
ALFWorld step prompts are 300-900 tokens with the household-trained tokenizer (longer than the
household world's), hence the 2048 buckets; a bucket is compiled only when a prompt needs it.
The first reset of each game translates its PDDL (~1 s) and is cached in memory afterwards.
Measured on 2 CPU cores shared with other jobs (load ~7): SFT 2-4 s a step (100 steps), then
~100 s per iteration (rollout 20 s, scoring 26 s, update 57 s); the whole run about 20 minutes.
"""

from configs.base import base_config, with_algo_env


def get_config():
    c = with_algo_env(base_config(), "strata", "alfworld")
    c.iterations = 8
    c.algo.tasks_per_iter = 4
    c.algo.num_strategies = 2
    c.algo.traj_per_strategy = 2
    c.algo.oversample = 2
    c.algo.strategy_budget = 64
    c.algo.milestones = "facts"

    c.env.data_dir = "data/alfworld"  # relative to where launch.py runs; see the docstring
    c.env.split = "valid_seen"
    c.env.eval_split = "valid_unseen"
    c.env.max_steps = 15  # L* of these games is 4-8 high-level steps (plus opens / searching)
    c.env.history_length = 1  # ALFWorld observations are long: one recent step keeps prompts short
    c.env.num_workers = 0  # in-process: the per-game PDDL translations are shared in memory
    # The household world only feeds the tokenizer and the SFT demonstrations (as in tiny_household).
    c.env.horizon_min = 2
    c.env.horizon_max = 8

    c.model.path = ""  # "" = build the tiny model and SFT it on household expert demos
    c.model.tiny_vocab = 2048  # enough merges that household (= ALFWorld) words are single tokens
    c.model.tiny_heads = 2
    c.model.tiny_kv_heads = 1

    # With the household-trained tokenizer "<think>I follow my strategy.</think><action>CMD</action>"
    # is 17-36 tokens for ALFWorld's commands (p99 27, "take toiletpaper 3 from toiletpaperhanger 1"
    # 36) and the household plans of L* <= 8 are <= 62 tokens: a smaller budget cuts the closing tag
    # and every such output parses as invalid.
    c.sampling.max_action_tokens = 40
    c.sampling.max_strategy_tokens = 72
    c.sampling.max_judge_tokens = 12
    c.sampling.prompt_buckets = (512, 768, 1024, 2048)
    c.sampling.batch_buckets = (8, 16, 32)

    c.train.lr = 1e-4
    c.train.mini_batch_rows = 64
    c.train.length_buckets = (512, 768, 1024, 2048)
    # ALFWorld rows are 500-900 tokens: widths 64 apart (not 256) for the shared-prefix update and
    # scoring, for a few more compiled update programs. Update tokens at this config's sizes: StraTA
    # -4.5%, GRPO -9.5%; at 50-step episodes with M = 8: -16% and -3.5% (docs/BENCHMARKS.md,
    # "Modelled at Qwen2.5-7B").
    c.train.bucket_steps = 8

    c.sft.steps = 100  # 32 rows of <= 512 tokens: ~2-4 s a step on 2 busy cores
    c.sft.lr = 3e-3
    c.sft.batch_rows = 32

    c.eval.every = 4
    c.eval.num_tasks = 16  # the first 16 of valid_unseen (see the trainer's eval_tasks)
    c.eval.greedy = False
    c.checkpoint.every = 2
    return c
