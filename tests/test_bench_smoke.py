"""bench/gpu.sh --smoke: the device benchmarks' code paths on tiny shapes on the CPU.

The GPU is lent rarely and for minutes. A benchmark that broke since it last ran there costs a
lent session its budget (bench/sampler.py --gpu once called the sampler with an old signature).
"""

import os
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_gpu_script_smoke_runs_every_headline_part():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as on the GPU
    out = subprocess.run(["bash", "bench/gpu.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "FAILED" not in text, text[-3000:]
    assert re.search(r"sampler gpu decode: \d+ tok/s, [\d.]+ ms/step; .*% of roofline", text), text[-3000:]
    assert re.search(r"train_step qwen2-0.5B-shape .* remat, attention einsum: [\d,]+ tok/s", text), text[-3000:]
