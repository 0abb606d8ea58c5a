"""The policy update with LoRA adapters against full fine-tuning, side by side in one process.

    python bench/lora.py                       # SmolLM2-135M's shape, 4 rows x 384 tokens, ranks 8 and 16
    python bench/lora.py --ranks 8 --rows 2 --length 256 --iters 3
    python bench/lora.py --model-only          # the H100 memory arithmetic alone (no step is run)

Each arm builds the train step the trainer builds (strata_jax.train.make_train_step: forward,
chunked log-probs, PPO loss, backward, clip + AdamW; remat over scanned layers as
configs/smol_household.py runs it) on random weights of the model's shape, and runs it on the same
random mini-batch, arms interleaved. Prints per arm the median seconds per step and XLA's memory
for the step (its buffer assignment: arguments + temporaries; nothing is estimated), and the
LoRA arms' ratios to full fine-tuning:

    lora: rank 8: 2.41 s/step (0.71x full), step memory 1.23 GB (0.46x full)

Then the memory arithmetic (strata_jax/memory.py) for one H100 (80 GB) at Qwen2.5-1.5B and 7B,
full fine-tuning against LoRA rank 16, one run and a population of K = 4 (`ablate --train`):
weights, gradients, AdamW moments and the second weight copy (the reference, or LoRA's merged
decode weights), with bf16 weights and fp32 moments as on a GPU, before activations.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _arms(ranks):
    return [("full", 0), *((f"rank {r}", r) for r in ranks)]


def model_memory() -> None:
    from strata_jax import memory
    from strata_jax.cost import MODELS

    gb = 1e9
    print("memory on one H100 (80 GB) before activations: bf16 weights, fp32 AdamW moments and gradients")
    for name in ("qwen2.5-1.5b", "qwen2.5-7b"):
        base = dataclasses.replace(MODELS[name], param_dtype="bfloat16")
        p = memory.num_params(base)
        for arm, rank in (("full", 0), ("LoRA r16", 16)):
            m = dataclasses.replace(base, lora_rank=rank)
            trained = memory.num_lora_params(m) if rank else p
            weights = (p + (memory.num_lora_params(m) if rank else 0)) * 2
            moments, grads = 8 * trained, 4 * trained  # fp32 AdamW moments and gradients
            second = weights  # reference (full) or merged decode copy (LoRA)
            one = weights + grads + moments + second
            pop = weights + second + 4 * (grads + moments + (4 * trained if rank else 0))
            if not rank:  # K full copies: each its own weights too
                pop = 4 * (weights + grads + moments) + second
            print(
                f"lora: {name} {arm}: trained {trained / 1e6:.1f}M of {p / 1e6:.0f}M; one run {one / gb:.1f} GB "
                f"({'fits' if one < 80 * gb else 'does not fit'}), population K=4 {pop / gb:.1f} GB "
                f"({'fits' if pop < 80 * gb else 'does not fit'})"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="an HF directory, a .gguf file or a named model (its shape)")
    p.add_argument("--ranks", default="8,16")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--length", type=int, default=384)
    p.add_argument("--window", type=int, default=48, help="response tokens per row (the loss window)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--model-only", action="store_true", help="print the H100 arithmetic only")
    a = p.parse_args()
    if a.model_only:
        model_memory()
        return

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rollout.warmstart import model_source
    from strata_jax import lora
    from strata_jax.batch import TokenBatch
    from strata_jax.loss import LossConfig
    from strata_jax.models.config import ModelConfig
    from strata_jax.models.gguf import gguf_config
    from strata_jax.models.hf import load_hf_config
    from strata_jax.models.qwen2 import Decoder
    from strata_jax.sharding import make_mesh
    from strata_jax.train import init_train_state, make_optimizer, make_train_step

    src = model_source(a.model)
    hf = load_hf_config(src) if src.is_dir() else gguf_config(src)
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    rng = np.random.default_rng(0)
    s, t, w = a.rows, a.length, a.window
    tokens = rng.integers(3, int(hf["vocab_size"]), size=(s, t)).astype(np.int32)
    loss = np.zeros((s, t), bool)
    loss[:, -w:] = True
    batch = TokenBatch(
        tokens=tokens,
        attention_mask=np.ones((s, t), bool),
        loss_mask=loss,
        old_logp=np.full((s, t), -3.0, np.float32) * loss,
        ref_logp=np.zeros((s, t), np.float32),
        advantage=rng.standard_normal((s, t)).astype(np.float32) * loss,
        row_index=np.zeros((s, 4), np.int32),
        row_valid=np.ones(s, bool),
        penalty_mask=np.zeros((s, t), bool),
    )
    opt = make_optimizer({"lr": 1e-5})
    arms = {}
    for name, rank in _arms(int(r) for r in a.ranks.split(",") if r):
        m = ModelConfig.from_hf(hf, scan_layers=True, remat=True, lora_rank=rank)
        graphdef, params = nnx.split(Decoder(m, rngs=nnx.Rngs(0)), nnx.Param)
        frozen = None
        if rank:
            params, frozen = lora.split(params)
        state = init_train_state(graphdef, params, opt, 0, mesh, frozen=frozen)
        step = make_train_step(graphdef, opt, LossConfig(kl_coef=0.0, reference=False), mesh, logprob_window=w)
        ma = step.jitted.lower(state, batch, jnp.float32(0.5)).compile().memory_analysis() if step.jitted else None
        state, _ = step(state, batch, 0.5)  # compile and warm up
        jax.block_until_ready(state)
        if ma is None:
            ma = step.jitted.lower(state, batch, jnp.float32(0.5)).compile().memory_analysis()
        arms[name] = {
            "state": state,
            "step": step,
            "times": [],
            "bytes": ma.argument_size_in_bytes + ma.temp_size_in_bytes,
        }
    for _ in range(a.iters):  # interleaved: a slow spell of the host hits every arm alike
        for arm in arms.values():
            t0 = time.perf_counter()
            arm["state"], metrics = arm["step"](arm["state"], batch, 0.5)
            jax.block_until_ready(metrics)
            arm["times"].append(time.perf_counter() - t0)
    full = arms["full"]
    ft, fb = statistics.median(full["times"]), full["bytes"]
    print(f"{src.name}: update step on {s} rows x {t} tokens ({w} in the loss), median of {a.iters}")
    for name, arm in arms.items():
        sec, by = statistics.median(arm["times"]), arm["bytes"]
        print(
            f"lora: {name}: {sec:.2f} s/step ({sec / ft:.2f}x full), step memory {by / 1e9:.2f} GB "
            f"({by / fb:.2f}x full)"
        )
    model_memory()


if __name__ == "__main__":
    main()
