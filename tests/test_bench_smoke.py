"""bench/gpu.sh --smoke: the device benchmarks' code paths on tiny shapes on the CPU.

The GPU is lent rarely and for minutes. A benchmark that broke since it last ran there costs a
lease its budget (a call of the sampler with an outdated signature, say), so this catches it on the
CPU first.
"""

import os
import pathlib
import re
import shutil
import subprocess

import pytest

# Each test runs bench/gpu.sh's parts (timed train steps; for --learning, SFT and RL through
# launch.py) in subprocesses: the slow tier (`-m 'not slow'` skips it).
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_gpu_script_smoke_runs_every_headline_part():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as on the GPU
    out = subprocess.run(
        ["bash", "bench/gpu.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "FAILED" not in text, text[-3000:]
    assert re.search(r"sampler gpu decode: \d+ tok/s, [\d.]+ ms/step; .*% of roofline", text), text[-3000:]
    assert len(re.findall(r"sampler gpu decode: \d+ tok/s", text)) == 2, text[-3000:]  # fused, then unfused
    assert "float32 params, unfused decode" in text, text[-3000:]
    assert re.search(r"train_step smoke-shaped qwen2 .* remat, attention einsum: [\d,]+ tok/s", text), text[-3000:]
    for backward in ("hand-written", "autodiff"):
        assert re.search(rf"head fwd\+bwd B=2 T=16 D=32 V=1000 .*{backward} backward on cpu: [\d.]+ ms", text), text[
            -3000:
        ]


def test_gpu_script_learning_smoke_runs_both_learning_rates():
    """`--learning --smoke`: the household learning experiment's flow (a warm start, then RL at
    each of LEARNING_LRS, the later runs from the first run's warm start), on the default model."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["LEARNING_LRS"] = "1e-4 3e-5"
    out = subprocess.run(
        ["bash", "bench/gpu.sh", "--learning", "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    for lr in ("1e-4", "3e-5"):
        assert re.search(rf"launch.py --learning train.lr {lr}: rc 0, \d+ s", text), text[-3000:]
        assert re.search(rf"learning train.lr {lr}: held-out [\d.]+ -> [\d.]+ \([+-][\d.]+; goal \+0\.15\)", text), (
            text[-3000:]
        )
    dirs = {lr: pathlib.Path(d) for lr, d in re.findall(r"train.lr (\S+), workdir (\S+)", text)}
    try:
        assert (dirs["1e-4"] / "sft_model" / "config.json").exists()
        assert not (dirs["3e-5"] / "sft_model").exists()  # no second warm start: it reused the first
        assert f'"path": "{dirs["1e-4"] / "sft_model"}"' in (dirs["3e-5"] / "config.json").read_text()
    finally:
        shutil.rmtree(dirs["1e-4"].parent, ignore_errors=True)
