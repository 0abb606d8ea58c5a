"""The runtime path works without torch (a dev-only dependency): a user's `pip install -e .` has none.

A subprocess sets sys.modules["torch"] = None, which makes every `import torch` fail (transformers
then also sees no torch), imports every runtime module, builds both tiny models (byte-level BPE and
sentencepiece tokenizers) and loads them with our loader. A torch import anywhere on that path fails
the test. The CI smoke (.ci/run) checks the same end to end in a virtualenv without torch.
"""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = r"""
import importlib, pkgutil, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import numpy as np
import rollout, strata_jax
for pkg in (strata_jax, rollout):
    for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(mod.name)
import launch  # noqa: F401  (defines the flags; its main runs only as __main__)
from strata_jax.models.hf import load_hf_model, load_tokenizer
from strata_jax.models.tiny import make_tiny_model

out = sys.argv[1]
small = dict(vocab_size=384, hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64)
for arch in ("qwen2", "llama"):
    path = make_tiny_model(f"{out}/{arch}", arch, **small)
    model, cfg = load_hf_model(path)
    tok = load_tokenizer(path)
    ids = np.asarray([tok.encode("go to countertop 1", add_special_tokens=False)], np.int32)
    hidden, _ = model(ids, np.arange(ids.shape[1], dtype=np.int32)[None], np.ones_like(ids, bool))
    assert np.isfinite(np.asarray(model.logits(hidden))).all()
    print("ok", arch, cfg.arch, flush=True)
assert sys.modules["torch"] is None
"""


def test_runtime_path_needs_no_torch(tmp_path):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, cwd=REPO, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.split() == ["ok", "qwen2", "qwen2", "ok", "llama", "llama"]
