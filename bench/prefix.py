"""Shared-prefix prefill (SamplerConfig.shared_prefix) against the plain one, on StraTA-shaped batches.

A batch is G groups of M rows. The rows of a group share a prefix (intro, task, strategy, start
memory) and end in their own suffix (recent steps, observation, admissible actions): what one
action call of a StraTA rollout sends. Random tiny model (hidden 128, 4 layers, vocab 512, f32),
random tokens, greedy, `--new` new tokens. Both samplers are compiled first; the runs are
interleaved, best of `--repeats`. Prints, per shape, the padded prefill tokens and the wall time
of `generate` for each, and the speed-up:

    python bench/prefix.py                       # the household config's action call and an ALFWorld-sized one
    python bench/prefix.py --shapes 8x4:160+160  # G x M : prefix + suffix tokens
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ARGS = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ARGS.add_argument(
    "--shapes",
    default="8x4:160+160,4x8:1024+384",
    help="comma-separated GxM:PREFIX+SUFFIX (groups x rows per group : token counts)",
)
ARGS.add_argument("--new", type=int, default=24, help="new tokens per row (the default's action budget)")
ARGS.add_argument("--repeats", type=int, default=3)
OPTS = ARGS.parse_args()

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from strata_jax.models.config import ModelConfig  # noqa: E402
from strata_jax.models.tiny import init_params  # noqa: E402
from strata_jax.sampling import Sampler, SamplerConfig, SamplingParams  # noqa: E402

VOCAB = 512
MODEL = dict(
    model_type="qwen2",
    vocab_size=VOCAB,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    tie_word_embeddings=True,
    rope_theta=1e6,
    max_position_embeddings=4096,
)


def parse(shape: str) -> tuple[int, int, int, int]:
    groups, rest = shape.split("x")
    m, lens = rest.split(":")
    pre, suf = lens.split("+")
    return int(groups), int(m), int(pre), int(suf)


def prompts_for(g: int, m: int, pre: int, suf: int, rng) -> list[list[int]]:
    """G prefixes, each continued by M suffixes whose lengths vary by up to a quarter (steps differ)."""
    out = []
    for _ in range(g):
        head = [int(x) for x in rng.integers(1, VOCAB, size=pre)]
        for _ in range(m):
            n = int(suf - rng.integers(0, max(suf // 4, 1)))
            out.append(head + [int(x) for x in rng.integers(1, VOCAB, size=n)])
    return out


def main() -> None:
    graphdef, params = init_params(ModelConfig.from_hf(MODEL), seed=0)
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0)
    for shape in OPTS.shapes.split(","):
        g, m, pre, suf = parse(shape)
        prompts = prompts_for(g, m, pre, suf, rng)
        longest = max(map(len, prompts))
        bucket = 1 << (longest - 1).bit_length()
        base = SamplerConfig(
            max_new_tokens=OPTS.new,
            prompt_buckets=(bucket,),
            batch_buckets=tuple(sorted({4, 8, 16, 32, 64, len(prompts)})),
            eos_ids=(),
            pad_id=0,
        )
        plain = Sampler(graphdef, base)
        shared = Sampler(graphdef, dataclasses.replace(base, shared_prefix=True))
        ref = plain.generate(params, prompts, sp, jax.random.key(0))  # compiles
        out = shared.generate(params, prompts, sp, jax.random.key(0))
        if shared.shared_calls != 1:
            raise SystemExit(f"{shape}: the planner did not share (saving under min_prefix_saving)")
        same = bool(np.array_equal(ref.tokens, out.tokens))
        tokens = (plain.prefill_tokens, shared.prefill_tokens)
        best = [float("inf"), float("inf")]
        for _ in range(OPTS.repeats):
            for i, s in enumerate((plain, shared)):
                t = time.perf_counter()
                s.generate(params, prompts, sp, jax.random.key(0))
                best[i] = min(best[i], time.perf_counter() - t)
        print(
            f"prefix {shape:16s} rows {len(prompts):3d}  prefill tokens {tokens[0]:6d} -> {tokens[1]:6d}  "
            f"generate {1000 * best[0]:7.1f} -> {1000 * best[1]:7.1f} ms  speed-up {best[0] / best[1]:.2f}x  "
            f"same tokens: {same}"
        )


if __name__ == "__main__":
    main()
