"""Decoder parity against transformers' PyTorch Qwen2 / Llama on tiny random configs."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from strata_jax.models.hf import load_hf_model  # noqa: E402

BASE = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=48)


def _hf_dir(tmp_root, name, arch, **kw):
    torch.manual_seed(0)
    conf = {**BASE, **kw}
    model = (Qwen2ForCausalLM(Qwen2Config(**conf)) if arch == "qwen2"
             else LlamaForCausalLM(LlamaConfig(**conf))).eval()
    # Random init has tiny norms; perturb everything so a wrong mapping shows up in the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    d = tmp_root / name
    model.save_pretrained(d)
    return d, model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_models")
    return {
        "qwen2": _hf_dir(root, "qwen2", "qwen2", rope_theta=1e6),
    }


def _batch(seed=0, b=3, t=9, vocab=97):
    """Left-padded batch: row r has r*2 padding tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=(b, t))
    mask = np.ones((b, t), bool)
    for r in range(b):
        mask[r, : 2 * r] = False
    tokens = np.where(mask, tokens, 0)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return tokens.astype(np.int32), pos.astype(np.int32), mask


def _ref_logits(model, tokens, pos, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(mask.astype(np.int64)),
                    position_ids=torch.tensor(pos, dtype=torch.long))
    return out.logits.float().numpy()


def _our_logits(model, tokens, pos, mask):
    hidden, _ = model(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask))
    return np.asarray(model.logits(hidden))


@pytest.mark.parametrize("name", ["qwen2"])
def test_fp32_parity(hf_models, name):
    path, ref = hf_models[name]
    model, _ = load_hf_model(path)
    tokens, pos, mask = _batch()
    diff = np.abs(_our_logits(model, tokens, pos, mask) - _ref_logits(ref, tokens, pos, mask))[mask]
    assert diff.max() <= 1e-4, diff.max()
