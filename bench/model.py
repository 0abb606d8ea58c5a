"""Forward throughput of the tiny default model: our jitted Decoder vs transformers PyTorch.

Both run one CPU thread on the same left-padded batch and produce full logits.
Usage: python bench/model.py [--batch 8] [--length 128] [--iters 10]
Prints one line: tokens/s of each and the ratio ours / torch.
"""

import os

# One thread for XLA too, so the comparison with torch.set_num_threads(1) is like for like.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from strata_jax.models.hf import load_hf_model  # noqa: E402
from strata_jax.models.tiny import make_tiny_model  # noqa: E402


def _median_time(fn, iters):
    fn()  # warm-up (compile)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    b, t = args.batch, args.length

    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model(d)
        (graphdef, params), cfg = load_hf_model(path, split=True)
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()

    rng = np.random.default_rng(0)
    mask = np.ones((b, t), bool)
    mask[::2, : t // 4] = False  # half the rows left-padded
    tokens = np.where(mask, rng.integers(1, cfg.vocab_size, (b, t)), 0).astype(np.int32)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)

    @jax.jit
    def fwd(p, tokens, pos, mask):
        m = nnx.merge(graphdef, p)
        return m.logits(m(tokens, pos, mask)[0])

    jt, jp, jm = jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask)
    ours = _median_time(lambda: fwd(params, jt, jp, jm).block_until_ready(), args.iters)
    tt, tp, tm = (torch.tensor(x.astype(np.int64)) for x in (tokens, pos, mask))

    def torch_fwd():
        with torch.no_grad():
            return ref(input_ids=tt, attention_mask=tm, position_ids=tp).logits

    theirs = _median_time(torch_fwd, args.iters)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(
        f"model_forward tiny {n_params / 1e6:.2f}M params B={b} T={t} 1 thread: "
        f"jax {b * t / ours:,.0f} tok/s, torch {b * t / theirs:,.0f} tok/s, ratio jax/torch {theirs / ours:.2f}"
    )


if __name__ == "__main__":
    main()
