"""The learnability check: does RL on this install make the agent better? (about 2 minutes, CPU)

    python launch.py --config configs/tiny_doors.py --workdir runs/doors

The doors world (rollout/envs/doors.py) is a corridor of two doors with two colours listed at
each; only the red one opens, and nothing in the prompt says so. The warm start (200 SFT steps on
a demonstrator that knows the command format but picks doors at random) is valid but weak:
success about 0.25. The reward alone teaches the rule, so held-out success rises towards 1 within
10 iterations when the pipeline is right (sampled tokens, log-probs, advantages, update), and
stays flat when it is not. Run it after installing on a new machine or porting to a new backend,
before a long run. tests/test_learnability.py runs the same set-up for every algorithm, with an
lr-0 control.

This is a check of the pipeline, not a study: the embedded default (configs/tiny_signs.py, the
same corridor with a signpost that a revised strategy must carry) is where the tiny model learns
something an agent needs; configs/tiny_household.py is ALFWorld's task grammar.
"""

from configs.base import base_config, with_algo_env


def doors(algo: str):
    c = with_algo_env(base_config(), algo, "doors")
    c.iterations = 10
    c.algo.tasks_per_iter = 8
    c.algo.group_size = 8
    c.algo.num_strategies, c.algo.traj_per_strategy, c.algo.oversample = 2, 4, 1
    # one candidate per strategy slot: nothing to select (bench/learning.py --ablation turns it on)
    c.algo.diverse = False
    c.algo.strategy_budget = 24
    c.env.horizon_min = c.env.horizon_max = 2
    c.env.max_steps = 2
    c.env.doors_options = 2
    c.env.history_length = 0
    c.env.show_first_observation = False
    c.model.tiny_hidden, c.model.tiny_layers, c.model.tiny_intermediate = 64, 2, 128
    c.model.tiny_heads, c.model.tiny_kv_heads, c.model.tiny_vocab = 4, 2, 640
    c.sampling.max_action_tokens, c.sampling.max_strategy_tokens, c.sampling.max_judge_tokens = 32, 24, 12
    c.sampling.prompt_buckets = (64, 128, 256, 512)
    c.sampling.batch_buckets = (16, 32, 64)
    c.train.length_buckets = (64, 128, 256, 512)
    c.train.lr = 1e-3
    c.train.mini_batch_rows = 16
    c.train.recompute_old_logp = False
    c.sft.steps, c.sft.lr, c.sft.batch_rows, c.sft.num_tasks = 200, 1e-2, 16, 64
    c.sft.styles = "both"  # strategy and flat prompts: one warm start serves every algorithm
    c.eval.every = 5
    c.eval.num_tasks = 64  # held-out corridors (seeds past env.eval_seed_offset)
    c.checkpoint.every = 5
    c.log.plots_every = 5
    return c


def get_config():
    return doors("strata")
