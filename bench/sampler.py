"""Sampler throughput.

CPU (default): ours vs transformers' PyTorch `generate` on the same tiny random model
(strata_jax.models.tiny defaults), prompt 128, 64 new tokens, batch 8 / 32 / 128, in one process
pinned to one core (sched_setaffinity before jax and torch start, so every thread of both shares
that core; torch.set_num_threads(1), XLA without its Eigen thread pool). Prints one line per batch
with the ratio (goal: >= 2x at batch 32) and our prefill / decode-step split.

    python bench/sampler.py                # 1 core each (the goal's setting)
    python bench/sampler.py --cores 2      # both on 2 cores (torch 2 threads, XLA its own pools)

GPU (--gpu): a random Qwen2 of a published shape (--model, default Qwen2.5-0.5B; no download,
initialised on the device) with bf16 compute and a bf16 KV cache, batch 256, prompt 128, 128 new
tokens. Prints prefill time, decode tokens/s, and the decode step's share of the HBM roofline:
(bytes of the weights as the loop reads them, in bf16, + bytes of the valid KV read per step) /
4.8 TB/s. --param-dtype float32 gives it float32 master weights, as the trainer's rollouts have
(the decode casts them once, strata_jax.models.qwen2.prepare_decode); --no-fuse decodes with the
model's separate q / k / v and gate / up kernels. --smoke shrinks the model so the same path runs
on a CPU in seconds.

    python bench/sampler.py --gpu [--smoke] [--model qwen2.5-7b] [--batch B] [--vocab V] [--layers L]
                            [--param-dtype float32] [--no-fuse]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

ARGS = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ARGS.add_argument("--gpu", action="store_true", help="0.5B-shaped bf16 model, batch 256, roofline share")
ARGS.add_argument("--smoke", action="store_true", help="with --gpu: tiny shapes, runs on the CPU")
ARGS.add_argument("--batch", type=int, default=None, help="--gpu: batch (default 256; smoke 8)")
ARGS.add_argument(
    "--vocab",
    type=int,
    default=None,
    help="--gpu: vocabulary instead of the model's (places the head + sampling share by difference)",
)
ARGS.add_argument("--profile", default="", help="--gpu: write a jax.profiler trace of one prefill + decode here")
ARGS.add_argument(
    "--layers",
    type=int,
    default=None,
    help="--gpu: layers instead of the model's (places the per-layer share by difference)",
)
ARGS.add_argument("--model", default="qwen2.5-0.5b", help="--gpu: a shape of strata_jax.cost.MODELS")
ARGS.add_argument("--param-dtype", default="bfloat16", help="--gpu: the weights' dtype (float32: master weights)")
ARGS.add_argument("--no-fuse", action="store_true", help="decode without fused q/k/v and gate/up kernels")
ARGS.add_argument("--batches", default="8,32,128", help="CPU mode: batch sizes")
ARGS.add_argument("--repeats", type=int, default=3, help="timed runs per setting (best is reported)")
ARGS.add_argument("--cores", type=int, default=1, help="CPU mode: cores the process is pinned to (torch threads)")
OPTS = ARGS.parse_args()

if not OPTS.gpu or OPTS.smoke:  # must be set before jax is imported
    os.environ["JAX_PLATFORMS"] = "cpu"
if not OPTS.gpu:
    # Pin before jax / torch create their thread pools: both then size them to the pinned cores,
    # and whatever threads they start share those cores, so neither side gets more CPU.
    _allowed = sorted(os.sched_getaffinity(0))
    if OPTS.cores > len(_allowed):
        ARGS.error(f"--cores {OPTS.cores}: only {len(_allowed)} cores available")
    os.sched_setaffinity(0, set(_allowed[: OPTS.cores]))
    if OPTS.cores == 1:
        os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from strata_jax.cost import MODELS  # noqa: E402
from strata_jax.sampling import Sampler, SamplerConfig, SamplingParams  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200
# --gpu --smoke: the same code path on tiny shapes, for a CPU.
SMOKE = dataclasses.replace(
    MODELS["qwen2.5-0.5b"],
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _best_pair(fn_a, fn_b, repeats: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Best (wall, cpu) seconds of two functions, runs interleaved so load changes hit both alike.

    CPU time (process_time) is the steadier figure on a shared machine: both sides run one thread.
    """
    best = [[float("inf")] * 2 for _ in range(2)]
    for _ in range(repeats):
        for i, fn in enumerate((fn_a, fn_b)):
            w, c = time.perf_counter(), time.process_time()
            fn()
            best[i] = [min(best[i][0], time.perf_counter() - w), min(best[i][1], time.process_time() - c)]
    return tuple(best[0]), tuple(best[1])


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(1, vocab, size=length)] for _ in range(batch)]


# ------------------------------------------------------------------------------------------ CPU


def bench_cpu(batches: list[int], prompt_len: int = 128, new: int = 64, repeats: int = 2, cores: int = 1) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from strata_jax.models.hf import load_hf_model
    from strata_jax.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model(os.path.join(d, "tiny"))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        (graphdef, params), cfg = load_hf_model(path, split=True)
    torch.set_num_threads(cores)  # the reference runs on every core the JAX sampler gets
    sampler = Sampler(
        graphdef,
        SamplerConfig(
            max_new_tokens=new,
            prompt_buckets=(prompt_len,),
            batch_buckets=tuple(batches),
            pad_id=0,
            fuse_decode=not OPTS.no_fuse,
        ),
    )
    sp = SamplingParams(temperature=1.0)
    sampler.generate(params, _prompts(batches[0], prompt_len, cfg.vocab_size), sp, jax.random.key(0))  # XLA up
    cpus = sorted(os.sched_getaffinity(0))
    print(
        f"model: tiny qwen2 L={cfg.num_layers} D={cfg.hidden_size} V={cfg.vocab_size}; prompt {prompt_len}, "
        f"{new} new tokens, sampling T=1; process pinned to {len(cpus)} core(s) {cpus}: torch "
        f"{torch.get_num_threads()} thread(s), XLA's pools on the same core(s) "
        f"({len(os.listdir('/proc/self/task'))} threads in the process); "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )
    for b in batches:
        prompts = _prompts(b, prompt_len, cfg.vocab_size)
        sampler.generate(params, prompts, sp, jax.random.key(0))  # compile
        ids = torch.tensor(prompts, dtype=torch.long)

        def ours(prompts=prompts):
            out = sampler.generate(params, prompts, sp, jax.random.key(1))
            assert np.all(out.lengths == new)

        def hf_run(ids=ids):
            with torch.no_grad():
                out = hf.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    use_cache=True,
                    pad_token_id=0,
                )
            assert out.shape[1] == prompt_len + new

        (w_ours, c_ours), (w_hf, c_hf) = _best_pair(ours, hf_run, repeats)
        n = b * new
        t_pre, t_dec = _prefill_decode(sampler, params, prompts, sp, repeats)
        print(
            f"sampler cpu batch={b:4d}: ours {n / w_ours:8.1f} tok/s  transformers {n / w_hf:8.1f} tok/s  "
            f"ratio {w_hf / w_ours:5.2f}x wall, {c_hf / c_ours:5.2f}x cpu-time (best of {repeats}); "
            f"ours: prefill {t_pre * 1e3:.1f} ms, decode {t_dec * 1e3 / (new - 1):.2f} ms/step"
        )


def _prefill_decode(sampler, params, prompts, sp, repeats: int) -> tuple[float, float]:
    """Best wall seconds of our prefill and of our decode loop (its new - 1 steps) alone."""
    tokens, consts, key, path, _ = sampler._prepare(prompts, sp, 1, None)
    assert path == "plain", path  # _prefill below is the unshared prompt's program
    t_pre, t_dec = float("inf"), float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        state = jax.block_until_ready(sampler._prefill(params, tokens, consts, key))
        t_pre = min(t_pre, time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(sampler._decode(params, state, consts))  # donates `state`
        t_dec = min(t_dec, time.perf_counter() - t)
    return t_pre, t_dec


# ------------------------------------------------------------------------------------------ GPU


def bench_gpu(
    smoke: bool,
    repeats: int,
    batch: int | None = None,
    vocab: int | None = None,
    layers: int | None = None,
    profile: str = "",
    model: str = "qwen2.5-0.5b",
    param_dtype: str = "bfloat16",
    fuse: bool = True,
) -> None:
    from strata_jax.models.qwen2 import Decoder

    if model not in MODELS:
        ARGS.error(f"--model {model!r}: not one of {sorted(MODELS)}")
    spec = SMOKE if smoke else MODELS[model]
    default_batch, prompt_len, new = (8, 16, 8) if smoke else (256, 128, 128)
    batch = batch or default_batch
    cfg = dataclasses.replace(
        spec,
        vocab_size=vocab or spec.vocab_size,
        num_layers=layers or spec.num_layers,
        dtype="bfloat16",
        param_dtype=param_dtype,
    )
    # Initialised on the device by one jitted program: a 7B model's weights never pass the host.
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    params = jax.jit(lambda: nnx.state(Decoder(cfg, rngs=nnx.Rngs(0))))()
    # What the decode loop reads per step: every weight once, in the compute dtype (bf16), except
    # an untied embedding table, of which it gathers only the batch's rows.
    weight_bytes = 2 * (
        sum(x.size for x in jax.tree.leaves(params))
        - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    )
    sampler = Sampler(
        graphdef,
        SamplerConfig(
            max_new_tokens=new,
            prompt_buckets=(prompt_len,),
            batch_buckets=(batch,),
            cache_dtype="bfloat16",
            pad_id=0,
            fuse_decode=fuse,
        ),
    )
    prompts = _prompts(batch, prompt_len, cfg.vocab_size)
    tokens, consts, key, path, _ = sampler._prepare(prompts, SamplingParams(temperature=1.0), 0, None)
    assert path == "plain", path  # prefill below is the unshared prompt's program

    def prefill():
        return jax.block_until_ready(sampler._prefill(params, tokens, consts, key))

    def decode(state):
        return jax.block_until_ready(sampler._decode(params, state, consts))

    t = time.perf_counter()
    decode(prefill())  # compile both
    compile_s = time.perf_counter() - t
    t_prefill = _best(prefill, repeats)
    times = []
    for _ in range(repeats):
        state = prefill()  # decode donates its state: a fresh one per run
        t = time.perf_counter()
        out = decode(state)
        times.append(time.perf_counter() - t)
    t_decode = min(times)
    if profile:  # one more prefill + decode under the profiler (xprof / TensorBoard read the trace)
        with jax.profiler.trace(profile):
            decode(prefill())
    lengths = np.asarray(out.lengths)
    assert np.all(lengths == new), lengths
    steps = new - 1  # the first token comes from prefill
    kv_per_slot = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * 2  # k and v, bf16
    # Valid slots read by decode step i (feeding token i-1): the prompt plus i generated tokens.
    kv_bytes = kv_per_slot * np.mean([prompt_len + i for i in range(1, new)])
    roofline_s = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S
    step_s = t_decode / steps
    name = "smoke (CPU)" if smoke else jax.devices()[0].device_kind
    print(
        f"model: {'smoke' if smoke else model}-shaped qwen2 L={cfg.num_layers} D={cfg.hidden_size} "
        f"V={cfg.vocab_size}, {weight_bytes / 1e6:.1f} MB of bf16 weights ({param_dtype} params, "
        f"{'fused' if fuse else 'unfused'} decode); batch {batch}, prompt {prompt_len}, "
        f"{new} new; device {name}; compile {compile_s:.1f} s; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )
    print(
        f"sampler gpu prefill: {t_prefill * 1e3:.2f} ms for {batch}x{prompt_len} tokens "
        f"({batch * prompt_len / t_prefill:.0f} tok/s)"
    )
    print(
        f"sampler gpu decode: {batch * steps / t_decode:.0f} tok/s, {step_s * 1e3:.3f} ms/step; "
        f"roofline {roofline_s * 1e3:.4f} ms/step (weights {weight_bytes / 1e6:.1f} MB + KV {kv_bytes / 1e6:.1f} MB "
        f"per step at 4.8 TB/s) -> {100 * roofline_s / step_s:.1f}% of roofline"
    )


if __name__ == "__main__":
    if OPTS.gpu:
        bench_gpu(
            OPTS.smoke,
            OPTS.repeats,
            OPTS.batch,
            OPTS.vocab,
            OPTS.layers,
            OPTS.profile,
            OPTS.model,
            OPTS.param_dtype,
            not OPTS.no_fuse,
        )
    else:
        bench_cpu([int(b) for b in OPTS.batches.split(",")], repeats=OPTS.repeats, cores=OPTS.cores)
