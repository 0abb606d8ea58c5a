"""The names the library answers to, defined once and without jax: the algorithms and the values of
its enumerated switches.

The modules that implement them import them from here (strata_jax.advantages, strata_jax.loss,
strata_jax.train, strata_jax.models.config, ...), and so does configs/base.py, which validates a
run config with them before any heavy import.
"""

from __future__ import annotations

# Every algorithm strata_jax.advantages computes (ALGORITHMS.md sections 1-4).
ALGOS = ("grpo", "gigpo", "strata", "beacon", "strata+beacon")
# Those that sample strategies (StraTA's levels: strategy rows, self-judgment, revisions) ...
STRATA_ALGOS = ("strata", "strata+beacon")
# ... and those whose step advantages are BEACON's milestone segments.
BEACON_ALGOS = ("beacon", "strata+beacon")

# AdvantageParams' normalisation switches (strata_jax/advantages/params.py), default first.
GIGPO_NORMS = ("std", "mean")
SEG_NORMS = ("mean", "std")
# How step rows weigh in the loss (strata_jax/advantages/weighting.py).
STEP_WEIGHTINGS = ("step", "trajectory")
# The loss's aggregation over tokens (strata_jax/loss.py).
AGGREGATIONS = ("token_mean", "seq_mean_token_mean")
# The optimiser's learning-rate schedules (strata_jax/train.py).
SCHEDULES = ("constant", "warmup_cosine")
# The decoder's attention implementations (strata_jax/models/qwen2.py).
ATTENTION_IMPLS = ("einsum", "xla", "cudnn")
# The projections a LoRA adapter may sit on, by short name -> the HF / PEFT module name.
LORA_TARGETS = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}
