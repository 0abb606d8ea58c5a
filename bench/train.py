"""Training throughput of the policy update.

Default (CPU): the tiny default model (strata_jax.models.tiny), our jitted train step (forward,
chunked log-probs, PPO loss, backward, clip + AdamW) vs the same weights in transformers PyTorch
(forward, log-softmax gather, the same PPO-clip loss, backward, clip + AdamW), one CPU thread
each on one pinned core, same batch and length, steps interleaved. Prints tokens/s of both and
the ratio ours / torch.

    python bench/train.py [--batch 8] [--length 128] [--iters 15] [--all-positions] [--default-malloc]

Both sides run in a process whose freed heap memory is kept (rollout/cpu_memory.py): XLA:CPU frees
its per-call buffers and a fresh mapping costs ~4 us per 4 KB page here; --default-malloc leaves
glibc as it is. Both sides compute the log-probs of the response window only, as the trainer does
(ours: `logprob_window` = the response length; torch: `logits_to_keep`); --all-positions computes
every position on both sides.

--shared-prefix: the update with shared prompt prefixes (`train.shared_prefix`, strata_jax/packing.py)
against the plain one, on the household config's model shape (hidden 64, 2 layers, vocab 2048) and
rows shaped like its StraTA action rows: G prefixes of ~180 tokens (intro, task, strategy, start
memory) shared by the rows of a strategy, a ~45-token step part and a 20-token response each,
mini-batches of --batch rows drawn at random from the G x M rows, one pinned thread, steps
interleaved. Prints the tokens through the model and the seconds per step of each, and checks that the losses agree.

    python bench/train.py --shared-prefix [--batch 64] [--groups 8] [--per-group 16] [--iters 10]

--gpu: model-FLOPs utilisation of a random Qwen2 of a published shape (--model, default
Qwen2.5-0.5B; initialised on the devices, no download), bf16 compute, fp32 master params, on all
local devices:  MFU = 6 * params * tokens/s / peak, peak = 989e12 (H200 dense bf16) per device.

    python bench/train.py --gpu [--model qwen2.5-1.5b] [--batch 16] [--length 2048] [--iters 10]
                                [--no-remat] [--attention cudnn]
    python bench/train.py --gpu --smoke      # tiny shape, runs on the CPU: checks the code path
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GPU = "--gpu" in sys.argv and "--smoke" not in sys.argv
# Before jax and torch start their threads (see rollout/cpu_memory.py); --default-malloc skips it.
if not GPU and "--default-malloc" not in sys.argv:
    from rollout.cpu_memory import keep_freed_memory  # noqa: E402

    MALLOC = "glibc, freed memory kept (rollout/cpu_memory.py)" if keep_freed_memory() else "default (not glibc)"
else:
    MALLOC = "default"
if not GPU:
    # Like for like with torch.set_num_threads(1): the process is pinned to one core before jax and
    # torch start (every thread of both shares it, as in bench/sampler.py), XLA without its Eigen
    # pool and with one intra-op thread.
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from strata_jax import sharding as sh  # noqa: E402
from strata_jax import train as T  # noqa: E402
from strata_jax.batch import TokenBatch  # noqa: E402
from strata_jax.cost import MODELS  # noqa: E402
from strata_jax.loss import LossConfig  # noqa: E402
from strata_jax.models.config import ModelConfig  # noqa: E402
from strata_jax.models.qwen2 import Decoder  # noqa: E402

H200_BF16_PEAK = 989e12
# --gpu --smoke: the same code path on tiny shapes, for a CPU.
SMOKE = dataclasses.replace(
    MODELS["qwen2.5-0.5b"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


def make_batch(b: int, t: int, vocab: int, seed: int = 0) -> TokenBatch:
    """Half the rows left-padded by t/4; the second half of every row is the trained response."""
    r = np.random.default_rng(seed)
    mask = np.ones((b, t), bool)
    mask[::2, : t // 4] = False
    tokens = np.where(mask, r.integers(1, vocab, (b, t)), 0).astype(np.int32)
    loss_mask = mask & (np.arange(t)[None] >= t // 2)
    logp = np.where(loss_mask, -np.log(vocab) + r.normal(0, 0.1, (b, t)), 0).astype(np.float32)
    adv = np.where(loss_mask, np.repeat(r.normal(size=(b, 1)), t, 1), 0).astype(np.float32)
    return TokenBatch(
        tokens=tokens,
        attention_mask=mask,
        loss_mask=loss_mask,
        old_logp=logp,
        ref_logp=logp,
        advantage=adv,
        row_index=np.zeros((b, 4), np.int32),
        row_valid=np.ones(b, bool),
    )


def _time_steps(step, state, batch, iters):
    """Median seconds per step after one warm-up (compile) step; the state is threaded through."""
    run = _jax_runner(step, state, batch)
    times = []
    for _ in range(iters):
        times.append(run())
    return float(np.median(times)), run


def _jax_runner(step, state, batch):
    """A function that runs one step (after a warm-up / compile step) and returns its seconds."""
    holder = {"state": state}

    def run():
        t0 = time.perf_counter()
        holder["state"], m = step(holder["state"], batch, 1.0)
        jax.block_until_ready((holder["state"].step, m))
        dt = time.perf_counter() - t0
        if not np.isfinite(float(m["loss"])):
            raise RuntimeError(f"benchmark produced a non-finite loss: {m}")
        return dt

    run()
    return run


def _jax_step(graphdef, params, mesh, lr=1e-6, chunk=8192, window=None):
    opt = T.make_optimizer(dict(lr=lr))
    state = T.init_train_state(graphdef, params, opt, 0, mesh, sh.DEFAULT_RULES)
    return T.make_train_step(
        graphdef,
        opt,
        LossConfig(track_entropy=False),
        mesh,
        sh.DEFAULT_RULES,
        1,
        logprob_chunk=chunk,
        logprob_window=window,
    ), state


def bench_cpu(args):
    import torch
    from transformers import AutoModelForCausalLM

    from strata_jax.models.hf import load_hf_model
    from strata_jax.models.tiny import make_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model(d)
        (graphdef, params), cfg = load_hf_model(path, split=True)
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    b, t = args.batch, args.length
    batch = make_batch(b, t, cfg.vocab_size)
    mesh = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    # The loss covers the second half of every row (make_batch): the trainer's window, on both sides.
    window = None if args.all_positions else t - t // 2
    step, state = _jax_step(graphdef, params, mesh, window=window)
    ours_run, theirs_run = _jax_runner(step, state, batch), _torch_runner(ref, batch, window)
    # Interleaved rounds (one step each, in turn), so that load drift on a shared machine hits
    # both sides alike; the median of each side.
    ours, theirs = [], []
    for _ in range(args.iters):
        ours.append(ours_run())
        theirs.append(theirs_run())
    ours, theirs = float(np.median(ours)), float(np.median(theirs))
    print(
        f"train_step tiny {n_params / 1e6:.2f}M params B={b} T={t} 1 thread (fwd+bwd+AdamW): "
        f"jax {b * t / ours:,.0f} tok/s, torch {b * t / theirs:,.0f} tok/s, ratio jax/torch {theirs / ours:.2f} "
        f"(median of {args.iters} interleaved steps; "
        f"log-probs of {'all positions' if window is None else 'the window'}; "
        f"load average {os.getloadavg()[0]:.1f}; malloc {MALLOC})"
    )


def _torch_runner(model, batch: TokenBatch, window: int | None):
    """The same update in PyTorch: PPO clip (0.2, dual clip 3) + k3 KL, token mean, clip 1.0, AdamW.
    With `window`, the logits of the last window + 1 positions only (the targets of the last window
    tokens), as our step's logprob_window. Returns a function that runs one step (after a warm-up
    step) and returns its seconds."""
    import torch

    tokens = torch.tensor(batch.tokens.astype(np.int64))
    mask = torch.tensor(batch.attention_mask.astype(np.int64))
    pos = torch.tensor(np.maximum(np.cumsum(batch.attention_mask, 1) - 1, 0).astype(np.int64))
    first = 1 if window is None else batch.tokens.shape[1] - window  # first target position
    if batch.loss_mask[:, :first].any():
        raise ValueError(f"the loss mask reaches before the window ({window} positions)")
    lm = torch.tensor(batch.loss_mask[:, first:].astype(np.float32))
    old, ref_lp, adv = (torch.tensor(x[:, first:]) for x in (batch.old_logp, batch.ref_logp, batch.advantage))
    keep = batch.tokens.shape[1] - first + 1  # logits at positions first-1 .. t-1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    model.train()

    def step():
        logits = (
            model(input_ids=tokens, attention_mask=mask, position_ids=pos, logits_to_keep=keep).logits[:, :-1].float()
        )
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, first:, None]).squeeze(-1)
        ratio = torch.exp(torch.clamp(logp - old, -20, 20))
        pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
        pg = torch.where(adv < 0, torch.minimum(pg, -3.0 * adv), pg)
        q = torch.clamp(ref_lp - logp, -10, 10)
        loss = ((pg + 0.01 * (torch.exp(q) - q - 1)) * lm).sum() / lm.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def run():
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0

    step()  # warm-up
    return run


def prefix_rows(groups: int, per_group: int, length: int, vocab: int, seed: int = 0) -> TokenBatch:
    """G x M rows [G*M, length], left-padded: a ~180-token prefix per group, then a ~45-token step
    part and a 20-token trained response per row (the household config's action rows), at most 256."""
    r = np.random.default_rng(seed)
    tok = lambda n: r.integers(1, vocab, n).tolist()  # noqa: E731
    s = groups * per_group
    tokens = np.zeros((s, length), np.int32)
    mask = np.zeros((s, length), bool)
    loss = np.zeros((s, length), bool)
    for g in range(groups):
        prefix = tok(int(r.integers(170, 187)))
        for m in range(per_group):
            row = prefix + tok(int(r.integers(40, 51))) + tok(20)
            i = g * per_group + m
            tokens[i, length - len(row) :] = row
            mask[i, length - len(row) :] = True
            loss[i, length - 20 :] = True
    logp = np.where(loss, -np.log(vocab) + r.normal(0, 0.1, (s, length)), 0).astype(np.float32)
    adv = np.where(loss, np.repeat(r.normal(size=(s, 1)), length, 1), 0).astype(np.float32)
    return TokenBatch(
        tokens=tokens,
        attention_mask=mask,
        loss_mask=loss,
        old_logp=logp,
        ref_logp=logp,
        advantage=adv,
        row_index=np.zeros((s, 4), np.int32),
        row_valid=np.ones(s, bool),
    )


def bench_shared(args):
    from strata_jax.models.tiny import init_params
    from strata_jax.packing import pack_shared

    cfg = ModelConfig.from_hf(
        dict(
            model_type="qwen2",
            vocab_size=2048,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=4096,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        )
    )
    graphdef, params = init_params(cfg, seed=0)
    length = 256  # the default's first length bucket: ~180 + ~45 + 20 tokens
    rows = prefix_rows(args.groups, args.per_group, length, cfg.vocab_size)
    # one mini-batch as the trainer cuts it (train.minibatches: a random draw of the iteration's rows)
    mb = next(T.minibatches(rows, args.batch, seed=0))
    packed = pack_shared(mb, 1, 1, (256,))
    if packed is None:
        raise RuntimeError("the rows share too little: no packing")
    shared = packed[0]
    arms = (("plain", mb), ("shared", shared))
    mesh = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    window = 96  # the default's logprob_window: max(action 24, strategy 96) tokens
    runners = {}
    for name, batch in arms:
        step, state = _jax_step(graphdef, jax.tree.map(jnp.copy, params), mesh, window=window)
        runners[name] = _jax_runner(step, state, batch)
    losses = {}
    for name, batch in arms:  # first-step losses from the same params
        step, st = _jax_step(graphdef, jax.tree.map(jnp.copy, params), mesh, window=window)
        losses[name] = float(step(st, batch, 1.0)[1]["loss"])
    times = {name: [] for name, _ in arms}
    for _ in range(args.iters):
        for name in times:
            times[name].append(runners[name]())
    sec = {k: float(np.median(v)) for k, v in times.items()}
    tok = {"plain": int(np.prod(mb.tokens.shape)), "shared": shared.model_tokens}
    u, tpre = shared.prefix_tokens.shape
    print(
        f"update tiny default shape, {args.batch} rows of {args.groups}x{args.per_group} (prefix ~180, step ~45, "
        f"response 20), 1 thread: tokens through the model {tok['plain']:,} -> {tok['shared']:,} "
        f"([{u}, {tpre}] prefixes + {list(shared.rows.tokens.shape)} suffixes); "
        f"{sec['plain'] * 1e3:.0f} -> {sec['shared'] * 1e3:.0f} ms/step, speed-up "
        f"{sec['plain'] / sec['shared']:.2f}x; loss {losses['plain']:.6f} vs {losses['shared']:.6f} "
        f"(median of {args.iters} interleaved steps; load average {os.getloadavg()[0]:.1f}; malloc {MALLOC})"
    )


def bench_gpu(args):
    spec = SMOKE if args.smoke else MODELS[args.model]
    cfg = dataclasses.replace(
        spec,
        dtype="bfloat16",
        param_dtype="float32",
        scan_layers=True,
        remat=not args.no_remat,
        attention=args.attention,
    )
    mesh = sh.make_mesh({"fsdp": -1})
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    # random init on the devices, already sharded: the fp32 params never exist on the host
    out_sh = sh.param_shardings(abstract, mesh, sh.DEFAULT_RULES)
    params = jax.jit(lambda: nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))[1], out_shardings=out_sh)()
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    b, t = (2, 32) if args.smoke else (args.batch, args.length)
    batch = make_batch(b, t, cfg.vocab_size)
    step, state = _jax_step(graphdef, params, mesh, chunk=args.chunk)
    sec, run = _time_steps(step, state, batch, 2 if args.smoke else args.iters)
    if args.profile:  # two more steps under the profiler (xprof / TensorBoard read the trace)
        with jax.profiler.trace(args.profile):
            run(), run()
    tok_s = b * t / sec
    n_dev = mesh.devices.size
    mfu = 6 * n_params * tok_s / (H200_BF16_PEAK * n_dev)
    kind = jax.devices()[0].device_kind
    note = " (smoke: tiny shape, MFU meaningless)" if args.smoke else ""
    print(
        f"train_step {'smoke' if args.smoke else args.model}-shaped qwen2 {n_params / 1e6:.1f}M params bf16 "
        f"B={b} T={t} on {n_dev}x {kind}: "
        f"{'remat' if cfg.remat else 'no remat'}, attention {cfg.attention}: {tok_s:,.0f} tok/s, "
        f"{sec * 1e3:.1f} ms/step, "
        f"MFU {100 * mfu:.1f}% of 989 TFLOP/s{note}"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--length", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--gpu", action="store_true", help="MFU of a Qwen2.5-shaped model in bf16")
    ap.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS), help="--gpu: the model's shape")
    ap.add_argument("--smoke", action="store_true", help="with --gpu: tiny shape on any backend")
    ap.add_argument("--chunk", type=int, default=8192, help="vocabulary chunk of the log-prob head")
    ap.add_argument("--no-remat", action="store_true", help="--gpu: keep activations instead of remat")
    ap.add_argument("--attention", default="einsum", help="--gpu: model.attention (einsum | cudnn | xla)")
    ap.add_argument("--profile", default="", help="--gpu: write a jax.profiler trace of two steps to this folder")
    ap.add_argument(
        "--all-positions",
        action="store_true",
        help="CPU: log-probs of every position on both sides (default: the response window)",
    )
    ap.add_argument(
        "--shared-prefix",
        action="store_true",
        help="CPU: the update with shared prompt prefixes vs the plain one (default-shaped rows)",
    )
    ap.add_argument("--groups", type=int, default=8, help="--shared-prefix: prefixes (strategies)")
    ap.add_argument("--per-group", type=int, default=16, help="--shared-prefix: rows per prefix")
    ap.add_argument(
        "--default-malloc",
        action="store_true",
        help="CPU: leave glibc malloc as it is (default: keep freed memory, rollout/cpu_memory.py)",
    )
    args = ap.parse_args()
    if args.smoke and not args.gpu:
        ap.error("--smoke goes with --gpu")
    if args.shared_prefix:
        args.batch, args.iters = args.batch or 64, args.iters or 10
        bench_shared(args)
    elif args.gpu:
        args.batch, args.length, args.iters = args.batch or 16, args.length or 2048, args.iters or 10
        bench_gpu(args)
    else:
        args.batch, args.length, args.iters = args.batch or 8, args.length or 128, args.iters or 15
        bench_cpu(args)


if __name__ == "__main__":
    main()
