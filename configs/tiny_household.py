"""A tiny random model on the built-in household world (ALFWorld's task grammar), on the CPU.

    python launch.py --config configs/tiny_household.py --workdir runs/household

Builds the model (random init, tokenizer trained on the household grammar), warm-starts it with
SFT on expert demonstrations, then trains StraTA; sized to finish in minutes on 2 CPU cores. At
this model size RL does not raise held-out success on the household world (docs/RESULTS.md: every
setting flat or lower), so the embedded default is the signpost corridor (configs/tiny_signs.py),
where it does. Use this config to check the household pipeline end to end, not to watch an agent
improve.
"""

from configs.base import base_config, with_algo_env


def get_config():
    c = with_algo_env(base_config(), "strata", "household")
    c.iterations = 12
    c.algo.tasks_per_iter = 4
    c.algo.num_strategies = 2
    c.algo.traj_per_strategy = 4
    c.algo.oversample = 2
    c.algo.strategy_budget = 64
    c.env.max_steps = 12
    c.env.history_length = 1
    c.env.show_first_observation = True  # where the objects are stays in every step prompt
    c.env.horizon_min = 2
    c.env.horizon_max = 8
    c.env.extra_receptacles = 1
    c.env.distractors = 3
    c.env.reveal_objects = True  # the tiny model plans from what it is told; it cannot learn to search in minutes
    c.sampling.max_action_tokens = 24
    c.sampling.max_strategy_tokens = 96
    c.sampling.max_judge_tokens = 12
    c.model.tiny_vocab = 2048  # enough merges that household words are single tokens
    c.model.tiny_heads = 2
    c.model.tiny_kv_heads = 1
    # up to 1280: a 12-step self-judgment prompt of budget-long actions reaches ~1,160 (tests/test_prompts.py)
    c.sampling.prompt_buckets = (256, 320, 384, 448, 512, 768, 1280)
    c.sampling.batch_buckets = (8, 16, 32, 64)  # 64 held-out tasks are sampled in one call
    c.train.lr = 3e-4
    c.train.mini_batch_rows = 64
    c.train.length_buckets = (256, 320, 384, 448, 512, 768, 1280)  # trained judgments (algo.judge_train) too
    c.train.recompute_old_logp = False
    c.sft.steps = 1500  # the tiny model learns to copy names from the prompt between 600 and 1500 steps
    c.sft.lr = 1.5e-2
    c.sft.batch_rows = 16
    c.sft.num_tasks = 1024
    c.sft.judge_share = 0.125
    c.sft.epsilon = 0.15  # epsilon-soft demonstrations: the warm start keeps exploring
    c.eval.every = 4
    c.eval.num_tasks = 64  # one task = 1.6 points
    c.checkpoint.every = 2
    c.log.plots_every = 4
    return c
