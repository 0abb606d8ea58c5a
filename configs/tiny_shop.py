"""A tiny random model on the offline WebShop-style store (rollout/envs/shop.py), on the CPU.

Like tiny_household: `python launch.py --config configs/tiny_shop.py` builds the tiny model (its
tokenizer trained on shop expert episodes), warm-starts it with SFT on the shop expert's
demonstrations, then trains StraTA. Results pages list 5 products (WebShop: 10) so prompts stay
under 768 tokens; L* then spans 3 (search, click, buy) to 8.
"""

from configs.base import base_config, with_algo_env


def get_config():
    c = with_algo_env(base_config(), "strata", "shop")
    c.iterations = 12
    c.algo.tasks_per_iter = 4
    c.algo.num_strategies = 2
    c.algo.traj_per_strategy = 4
    c.algo.oversample = 2
    c.algo.strategy_budget = 64
    c.env.max_steps = 12
    c.env.history_length = 1
    c.env.horizon_min = 3
    c.env.horizon_max = 8
    c.env.shop_page_size = 5
    c.sampling.max_action_tokens = 40  # p99 27 tokens with the shop tokenizer, max 40 (long queries)
    c.sampling.max_strategy_tokens = 96
    c.sampling.max_judge_tokens = 12
    c.model.tiny_vocab = 2048
    c.model.tiny_heads = 2
    c.model.tiny_kv_heads = 1
    # p99 of shop step rows ~630 tokens, max ~800; a self-judgment prompt lists up to 12 steps with
    # 150-character observation excerpts and budget-long actions (1,110 tokens seen; tests/test_shop.py
    # bounds the worst case)
    c.sampling.prompt_buckets = (256, 320, 384, 448, 512, 768, 1024, 1536, 2048)
    c.sampling.batch_buckets = (8, 16, 32)
    c.train.lr = 3e-4
    c.train.mini_batch_rows = 64
    c.train.length_buckets = (256, 320, 384, 448, 512, 768, 1024, 1536, 2048)  # trained judgments too
    c.train.recompute_old_logp = False
    c.sft.steps = 1500
    c.sft.lr = 1.5e-2
    c.sft.batch_rows = 16
    c.sft.num_tasks = 1024
    c.sft.judge_share = 0.125
    c.eval.every = 4
    c.eval.num_tasks = 32
    c.checkpoint.every = 2
    c.log.plots_every = 4
    return c
