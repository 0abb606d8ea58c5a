"""XLA's own memory figure for one SFT / update step against strata_jax/memory.py's estimate.

    python bench/memory.py                                  # SmolLM2-135M, 4 x 512 tokens, the four remat layouts
    python bench/memory.py --model /models/Qwen2.5-0.5B-Instruct --rows 8 --length 1024

Nothing is allocated: the step is lowered and compiled on abstract shapes and XLA's buffer
assignment gives its temporaries (`memory_analysis().temp_size_in_bytes`: activations, gradients
and scratch) and its arguments (weights and AdamW moments). Prints one line per layout,
`memory: ... XLA X.XX GB (temporaries T.TT + arguments A.AA), estimate E.EE GB`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="an HF directory, a .gguf file or a named model")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--window", type=int, default=64, help="response tokens that reach the vocabulary head")
    p.add_argument("--layouts", default="unrolled,unrolled+remat,scanned,scanned+remat")
    a = p.parse_args()

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from rollout.warmstart import model_source
    from strata_jax import memory
    from strata_jax.models.config import ModelConfig
    from strata_jax.models.gguf import gguf_config
    from strata_jax.models.hf import load_hf_config
    from strata_jax.models.qwen2 import Decoder
    from strata_jax.sft import make_sft_step

    src = model_source(a.model)
    hf = load_hf_config(src) if src.is_dir() else gguf_config(src)
    gb = 1e9
    for layout in a.layouts.split(","):
        scan, remat = "scanned" in layout, layout.endswith("+remat")
        m = ModelConfig.from_hf(hf, scan_layers=scan, remat=remat)
        graphdef, params = nnx.split(nnx.eval_shape(lambda m=m: Decoder(m, rngs=nnx.Rngs(0))), nnx.Param)
        opt = optax.adamw(1e-4)
        step = make_sft_step(graphdef, opt, 8192, window=a.window)
        shapes = [jax.ShapeDtypeStruct((a.rows, a.length), d) for d in (jnp.int32, jnp.bool_, jnp.float32)]
        ma = step.lower(params, jax.eval_shape(opt.init, params), *shapes).compile().memory_analysis()
        est = memory.estimate(m, "SFT", a.rows, a.length, train=True, remat=scan and remat, window=a.window)
        xla = ma.temp_size_in_bytes + ma.argument_size_in_bytes
        print(
            f"memory: {src.name} SFT step {a.rows} x {a.length} tokens, {layout}: XLA {xla / gb:.2f} GB "
            f"(temporaries {ma.temp_size_in_bytes / gb:.2f} + arguments {ma.argument_size_in_bytes / gb:.2f}), "
            f"estimate {(est.total - memory.OVERHEAD_BYTES) / gb:.2f} GB",
            flush=True,
        )


if __name__ == "__main__":
    main()
