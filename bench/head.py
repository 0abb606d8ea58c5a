"""The vocabulary head's forward and backward: per-token log-probs and entropy of [B, T, D] hidden
states through a [D, V] kernel (strata_jax/models/heads.py), as the update runs it.

Usage: python bench/head.py [--batch 1] [--length 256] [--hidden 896] [--vocab 151936]
                            [--dtype bfloat16] [--iters 5] [--entropy] [--autodiff] [--gpu]
Defaults are Qwen2.5-0.5B's head (hidden 896, vocab 151,936) in bf16 with float32 master weights.
Prints one line: ms per forward + backward (the minimum of --iters calls after a compiling one),
and XLA's count of the bytes one chunk's forward and backward move (its cost analysis counts a
loop body once), which does not move with the host's load.
--autodiff: the A/B baseline, jax's autodiff of the online-logsumexp scan instead of the head's
hand-written backward (how the head was differentiated before). --gpu: the default backend (else
the CPU).
"""

import os
import sys

if "--gpu" not in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from strata_jax.models import heads  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--entropy", action="store_true", help="also the entropy and its gradient (train.entropy_coef)")
    ap.add_argument("--autodiff", action="store_true", help="autodiff of the forward scan (the baseline)")
    ap.add_argument("--gpu", action="store_true", help="run on jax's default backend instead of the CPU")
    args = ap.parse_args()
    if args.autodiff:  # token_logprobs looks _lse_mean up at trace time
        heads._lse_mean = lambda h, k, c, m: heads._lse_mean_fwd(h, k, c, m)[0]
    b, t, d, v = args.batch, args.length, args.hidden, args.vocab
    r = np.random.default_rng(0)
    h = jnp.asarray(r.normal(size=(b, t, d)), args.dtype)
    w = jnp.asarray(r.normal(size=(d, v)) * d**-0.5, jnp.float32)
    tgt = jnp.asarray(r.integers(0, v, size=(b, t)), jnp.int32)
    a = jnp.asarray(r.normal(size=(b, t)), jnp.float32)

    def loss(h, w):
        logp, ent = heads.token_logprobs(h, w, tgt, args.chunk, args.entropy)
        return (logp * a).sum() + (0.01 * ent.sum() if args.entropy else 0.0)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, w).compile()
    cost = step.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    jax.block_until_ready(step(h, w))
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        jax.block_until_ready(step(h, w))
        times.append(time.perf_counter() - t0)
    print(
        f"head fwd+bwd B={b} T={t} D={d} V={v} {args.dtype}{' +entropy' if args.entropy else ''}"
        f"{', autodiff backward' if args.autodiff else ', hand-written backward'} "
        f"on {jax.devices()[0].device_kind}: {1e3 * min(times):.1f} ms (min of {args.iters}), "
        f"{(cost or {}).get('bytes accessed', float('nan')) / 1e9:.3f} GB per chunk "
        f"(load average {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    main()
