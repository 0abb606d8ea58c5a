"""LoRA adapters (strata_jax/lora.py), each property compared with something computed another way.

In process, on a tiny HF Qwen2 directory (2 layers, every projection with its own fan-in / out):
- zero B: the LoRA decoder's logits equal those of the decoder loaded without adapters, bitwise;
- merge: the LoRA decoder on (frozen, random adapters) equals the plain decoder on `merged_params`,
  whose kernels equal W + (alpha / r) A B formed here in numpy; `adapters_off` gives the plain
  decoder on the frozen base exactly; the PEFT tensors do not depend on the layer layout;
- train step: the base stays bitwise, every adapter moves, AdamW holds two moments of the adapters'
  size only, and the step's gradient (read back from AdamW's first moment, mu = (1 - b1) g) equals
  the chain rule through the *plain* decoder's kernel gradient G at the merged weights:
  dA = s G B^T, dB = s A^T G;
- memory.num_lora_params equals the size of a real adapter state and the fan-in / fan-out sum.

Through `launch.py` (a random tiny household model as tests/test_population.py uses: every step
is invalid, so invalid_penalty gives every row an advantage; rank 4, lr 1e-2 so the adapters move):
- the sampler holds the plain decoder's params (the paths, shapes and bytes of the model loaded
  without LoRA, its graphdef that model's) and its greedy tokens and log-probs are the
  teacher-forced (unmerged) LoRA model's; the reference policy is the base model exactly;
- `launch.py export`: transformers' logits of the merged directory, and `peft.PeftModel`'s of the
  adapter over the start model's directory, equal our LoRA model's from the run's checkpoint;
- a run whose last checkpoint is deleted resumes to the uninterrupted run's metrics and adapters;
  its checkpoints hold adapters (and their two moments) only;
- `launch.py ablate --train` stacks adapters only, and copy k's adapters, optimiser state and
  metrics equal its separate run's (tests/test_population.py's tolerances).
"""

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs.base import apply_overrides
from strata_jax import lora, memory
from strata_jax.models.config import ModelConfig
from strata_jax.models.hf import load_hf_config, load_hf_model
from strata_jax.models.tiny import make_tiny_model
from tests.test_hf import _batch as hf_batch
from tests.test_launch import CONFIG, launch, metrics
from tests.test_population import _compare_rows, _max_diff

TEXTS = [
    "go to countertop 1",
    "take apple 1 from countertop 1",
    "You open the fridge 1.",
    "Your task is to: put a clean mug in the coffeemachine.",
    "Nothing happens.",
] * 4
SMALL = dict(vocab_size=384, hidden_size=32, layers=2, heads=4, kv_heads=2, intermediate_size=64)
# SMALL's (fan-in, fan-out) per projection: q 4 heads x 8, k / v 2 kv heads x 8, MLP 64
FAN = {"q": (32, 32), "k": (32, 16), "v": (32, 16), "o": (32, 32), "gate": (32, 64), "up": (32, 64), "down": (64, 32)}
HF_NAME = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}
ALL = tuple(FAN)
FAST = {"xla_backend_optimization_level": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2", TEXTS, tie=True, **SMALL)


def _batch(vocab):
    """Three left-padded rows (row 1 has 4 padding columns) and their positions."""
    return hf_batch(vocab, b=3)


@functools.partial(jax.jit, static_argnums=0)
def _logits_jit(graphdef, params, tokens, pos, mask):
    model = nnx.merge(graphdef, params)
    hidden, _ = model(tokens, pos, mask)
    return model.logits(hidden)


def _logits(graphdef, params, tokens, pos, mask) -> np.ndarray:
    return np.asarray(_logits_jit(graphdef, params, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask)))


def _flat(state) -> dict:
    return {tuple(k): np.asarray(jax.device_get(v.get_value())) for k, v in nnx.to_flat_state(state)}


def _with_values(state, values: dict):
    """`state` with each leaf replaced by values[path] (same Variable types and metadata)."""
    return nnx.from_flat_state([(k, v.replace(jnp.asarray(values[tuple(k)]))) for k, v in nnx.to_flat_state(state)])


def _random_b(adapters, seed: int, std: float = 0.05):
    """The adapters with every B drawn N(0, std^2) (A kept): a LoRA model that differs from its base."""
    rng = np.random.default_rng(seed)
    flat = _flat(adapters)
    return _with_values(
        adapters,
        {k: (rng.normal(0, std, v.shape).astype(v.dtype) if k[-1] == "lora_b" else v) for k, v in flat.items()},
    )


def _pairs(flat_adapters: dict) -> dict:
    """{projection path: (A, B)} of a flat adapters dict."""
    return {k[:-2]: (v, flat_adapters[k[:-1] + ("lora_b",)]) for k, v in flat_adapters.items() if k[-1] == "lora_a"}


def _numpy_merge(flat_frozen: dict, flat_adapters: dict, scale: float) -> dict:
    """W + scale * A B for every adapted kernel, in float64 then W's dtype; A [(L,) in, r],
    B [(L,) r, out], W [(L,) *in, *out]."""
    out = dict(flat_frozen)
    for path, (a, b) in _pairs(flat_adapters).items():
        w = flat_frozen[path + ("kernel",)]
        delta = scale * np.matmul(a.astype(np.float64), b.astype(np.float64))
        out[path + ("kernel",)] = (w.astype(np.float64) + delta.reshape(w.shape)).astype(w.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# The decoder with adapters


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_zero_b_gives_the_base_logits_exactly(tiny, scan):
    tokens, pos, mask = _batch(SMALL["vocab_size"])
    (g0, p0), _ = load_hf_model(tiny, scan_layers=scan, split=True)
    (g, p), cfg = load_hf_model(tiny, scan_layers=scan, split=True, lora_rank=4)
    adapters, frozen = lora.split(p)
    flat = _flat(adapters)
    assert len(flat) == 2 * len(ALL) * (1 if scan else SMALL["layers"])
    assert all(np.abs(v).max() > 0 if k[-1] == "lora_a" else not v.any() for k, v in flat.items())
    assert _flat(frozen).keys() == _flat(p0).keys()  # the base is the plain decoder's params exactly
    base = _logits(g0, p0, tokens, pos, mask)
    ours = _logits(g, p, tokens, pos, mask)
    np.testing.assert_array_equal(ours, base)  # y + s (x A) 0 = y: bitwise
    # ... and the adapters are live: a nonzero B changes the logits
    moved = _logits(g, lora.join(frozen, _random_b(adapters, 0)), tokens, pos, mask)
    assert np.abs(moved - base).max() > 1e-2


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_merged_plain_decoder_equals_the_lora_decoder(tiny, scan):
    tokens, pos, mask = _batch(SMALL["vocab_size"])
    (g0, p0), _ = load_hf_model(tiny, scan_layers=scan, split=True)
    (g, p), cfg = load_hf_model(tiny, scan_layers=scan, split=True, lora_rank=4, lora_seed=3)
    adapters, frozen = lora.split(p)
    adapters = _random_b(adapters, 1)
    merged = jax.jit(functools.partial(lora.merged_params, cfg=cfg))(frozen, adapters)
    got, want = _flat(merged), _numpy_merge(_flat(frozen), _flat(adapters), cfg.lora_alpha / cfg.lora_rank)
    assert got.keys() == _flat(p0).keys() and all(got[k].shape == _flat(p0)[k].shape for k in got)
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=str(k))
    assert sum(not np.array_equal(got[k], _flat(frozen)[k]) for k in got) == len(ALL) * (1 if scan else 2)

    unmerged = _logits(g, lora.join(frozen, adapters), tokens, pos, mask)
    on_merged = _logits(g0, merged, tokens, pos, mask)
    base = _logits(g0, frozen, tokens, pos, mask)
    scale = np.abs(unmerged).max()
    assert np.abs(on_merged - unmerged).max() <= 1e-5 * scale
    assert np.abs(unmerged - base).max() > 1e-2 * scale  # the comparison above could fail
    # adapters off: the LoRA model is its base exactly, whatever A and B were
    off = _logits(g, lora.join(frozen, lora.adapters_off(adapters)), tokens, pos, mask)
    np.testing.assert_array_equal(off, base)


def test_peft_tensors_do_not_depend_on_the_layer_layout(tiny):
    """The same adapters held per layer (unrolled) and stacked [L, ...] (scan_layers) give the same
    PEFT tensors, each A^T [r, in] and B^T [out, r] of its own layer."""
    (_, p), cfg = load_hf_model(tiny, split=True, lora_rank=4, lora_targets=("q", "v", "down"))
    (_, ps), cfg_s = load_hf_model(tiny, split=True, lora_rank=4, lora_targets=("q", "v", "down"), scan_layers=True)
    adapters = _random_b(lora.split(p)[0], 2)
    flat = _flat(adapters)
    stacked = {}
    for k in _flat(lora.split(ps)[0]):
        stacked[k] = np.stack([flat[(k[0], i, *k[1:])] for i in range(SMALL["layers"])])
    unrolled_t = lora.peft_tensors(adapters, cfg)
    scan_t = lora.peft_tensors(_with_values(lora.split(ps)[0], stacked), cfg_s)
    assert unrolled_t.keys() == scan_t.keys() and len(unrolled_t) == 2 * 3 * SMALL["layers"]
    for name in unrolled_t:
        np.testing.assert_array_equal(unrolled_t[name], scan_t[name], err_msg=name)
    a = flat[("layers", 1, "mlp", "down_proj", "lora", "lora_a")]
    b = flat[("layers", 1, "mlp", "down_proj", "lora", "lora_b")]
    np.testing.assert_array_equal(unrolled_t["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"], a.T)
    np.testing.assert_array_equal(unrolled_t["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"], b.T)


@pytest.mark.parametrize("targets,rank", [(("q", "v", "down"), 4), (ALL, 8)], ids=["q-v-down", "all"])
def test_num_lora_params_counts_a_real_adapter_state(tiny, targets, rank):
    (_, p), cfg = load_hf_model(tiny, split=True, lora_rank=rank, lora_targets=targets)
    adapters, _ = lora.split(p)
    real = sum(v.size for v in _flat(adapters).values())
    by_hand = SMALL["layers"] * rank * sum(sum(FAN[t]) for t in targets)
    assert memory.num_lora_params(cfg) == lora.count(adapters) == real == by_hand
    assert memory.num_lora_params(ModelConfig.from_hf(load_hf_config(tiny))) == 0


def test_initial_a_scale_does_not_depend_on_the_layer_layout(tiny):
    """A is drawn He-uniform, variance 2 / fan_in per layer (flax's LoRA default), unrolled or
    scanned alike: the stacked [L] axis is not fan-in."""
    for scan in (False, True):
        (_, p), _ = load_hf_model(tiny, split=True, lora_rank=8, scan_layers=scan)
        z = [
            v.reshape(-1, *v.shape[-2:]) * np.sqrt(v.shape[-2])
            for k, v in _flat(lora.split(p)[0]).items()
            if k[-1] == "lora_a"
        ]
        std = np.concatenate([x.ravel() for x in z]).std()  # 7 x 2 x ~300 draws: +-2%
        assert abs(std - np.sqrt(2.0)) < 0.1, (scan, std)


def test_train_step_moves_the_adapters_only_along_their_gradient(tiny):
    from strata_jax import sharding as sh
    from strata_jax import train as T
    from strata_jax.loss import policy_loss
    from tests.test_train import LOSS, one_device, random_batch

    (g, p), cfg = load_hf_model(tiny, split=True, lora_rank=4)
    (g0, p0), _ = load_hf_model(tiny, split=True)
    adapters, frozen = lora.split(p)
    adapters = _random_b(adapters, 4)  # B != 0: A gets a gradient too
    a0, f0 = _flat(adapters), _flat(frozen)
    n = lora.count(adapters)
    batch = random_batch(5, S=8, L=12, vocab=64)
    assert np.abs(batch.advantage).max() > 0.1
    mesh = one_device()
    b1 = 0.9
    opt = T.make_optimizer(dict(lr=1e-3, b1=b1, grad_clip=1e9, weight_decay=0.0))  # no clip: mu = (1 - b1) g
    state = T.init_train_state(g, adapters, opt, 0, mesh, sh.DEFAULT_RULES, frozen=frozen)
    floats = [x for x in jax.tree.leaves(state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert sum(x.size for x in floats) == 2 * n  # AdamW's two moments of the adapters, nothing of the base
    step = T.make_train_step(g, opt, LOSS, mesh, sh.DEFAULT_RULES, compiler_options=FAST)
    state, m = step(state, batch, 0.5)
    assert int(m["applied"]) == 1

    after = _flat(state.frozen)
    assert after.keys() == f0.keys() and all(np.array_equal(after[k], f0[k]) for k in f0)  # bitwise
    moved = _flat(state.params)
    assert moved.keys() == a0.keys() and all(k[-1] in ("lora_a", "lora_b") for k in moved)
    assert all(not np.array_equal(moved[k], a0[k]) for k in a0)  # every A and every B moved
    got = {k: v / (1 - b1) for k, v in _flat(optax.tree_utils.tree_get(state.opt_state, "mu")).items()}

    # The chain rule through the plain decoder (no LoRA code): G = dLoss/dW at W' = W + s A B.
    s = cfg.lora_alpha / cfg.lora_rank
    merged = _with_values(p0, _numpy_merge(f0, a0, s))

    def plain_loss(params):
        logp, ent = T.sequence_logprobs(g0, params, batch.tokens, batch.attention_mask, 8192, True)
        loss_sum, count, _ = policy_loss(logp, batch, LOSS, 0.5, ent)
        return loss_sum / count

    grads = _flat(jax.jit(jax.grad(plain_loss), compiler_options=FAST)(merged))
    want = {}
    for path, (a, b) in _pairs(a0).items():
        gk = grads[path + ("kernel",)].reshape(a.shape[-2], b.shape[-1]).astype(np.float64)
        want[path + ("lora", "lora_a")] = s * gk @ b.T
        want[path + ("lora", "lora_b")] = s * a.T @ gk
    assert got.keys() == want.keys()
    for k in want:
        assert np.abs(want[k]).max() > 1e-6, k  # every adapter has a gradient to get right
        assert np.abs(got[k] - want[k]).max() <= 2e-5 * np.abs(want[k]).max(), k  # seen: 2e-6
    norm = np.sqrt(sum((w**2).sum() for w in want.values()))
    assert float(m["grad_norm"]) == pytest.approx(norm, rel=1e-4)


# ----------------------------------------------------------------------------------------------
# Runs through launch.py: a random tiny household model, as tests/test_population.py's
# small_config, with LoRA on every projection.

OVERRIDES = [
    "algo.tasks_per_iter=2",
    "algo.num_strategies=2",
    "algo.traj_per_strategy=2",
    "algo.oversample=2",
    "algo.judgment=False",
    "env.max_steps=4",
    "env.horizon_min=2",
    "env.horizon_max=4",
    "eval.every=0",
    "checkpoint.every=1",
    "train.mini_batch_rows=16",
    "train.lr=1e-2",
    "train.recompute_old_logp=True",
    "train.length_buckets=(512,)",
    "sampling.max_action_tokens=12",
    "sampling.max_strategy_tokens=16",
    "sampling.max_judge_tokens=8",
    "sampling.prompt_buckets=(512,)",
    "sampling.batch_buckets=(16,)",
    "log.progress=False",
    "log.plots_every=0",
    "model.tiny_hidden=32",
    "model.tiny_layers=1",
    "model.tiny_heads=2",
    "model.tiny_kv_heads=1",
    "model.tiny_intermediate=64",
    "model.tiny_vocab=1024",
    "sft.steps=0",
    "sft.read_steps=0",
    "model.lora_rank=4",
]
ITERATIONS = 2  # a top-level key: configs.base.apply_overrides reaches nested keys only
GRID = "invalid_penalty=0.1,0.4"  # 0.1 is the config's own: copy 0 is the straight run
PROMPTS = [[{"role": "user", "content": f"Your task is to: put apple {i} in the fridge 1."}] for i in range(4)]


def _config(model_path, *extra):
    from configs.tiny_household import get_config

    c = apply_overrides(get_config(), [*OVERRIDES, f"model.path={model_path}", *extra])
    c.iterations = ITERATIONS
    return c


def _flags(model_path, *extra) -> list[str]:
    return [
        *CONFIG,
        *(f"--config.{o}" for o in OVERRIDES),
        f"--config.iterations={ITERATIONS}",
        f"--config.model.path={model_path}",
        *extra,
    ]


def _saved(directory, step: int) -> dict:
    """{path: array} of the train state a checkpoint holds, read against its own metadata."""
    from strata_jax.checkpoint import Checkpointer, _nest
    from strata_jax.checkpoint import _flat as ck_flat

    ck = Checkpointer(directory, async_save=False)
    try:
        meta = ck._manager.item_metadata(step)["state"]
        pairs, _ = ck_flat(getattr(meta, "tree", meta))
        state, _ = ck.restore(step, _nest([(p, jax.ShapeDtypeStruct(m.shape, m.dtype)) for p, m in pairs]))
    finally:
        ck.close()
    return {p: np.asarray(v) for p, v in ck_flat(state)[0]}


def _is_adapter(path) -> bool:
    return "lora" in path and path[-2] in ("lora_a", "lora_b")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from rollout.setup import make_mesh
    from rollout.warmstart import model_dir

    c = _config("")  # model.path "": the tiny model is built (random: sft.steps=0)
    return model_dir(c, tmp_path_factory.mktemp("model"), make_mesh(c))


@pytest.fixture(scope="module")
def straight(model_path, tmp_path_factory):
    """2 LoRA iterations without interruption (invalid_penalty 0.1: population copy 0)."""
    work = tmp_path_factory.mktemp("straight")
    launch(*_flags(model_path), "--workdir", str(work))
    return work


@pytest.fixture(scope="module")
def lora_run(straight, model_path):
    """The straight run's last checkpoint, restored in process (trained adapters over the base)."""
    from rollout.run import Run

    run = Run(_config(model_path), straight, for_training=False)
    assert run.lora and run.start_iteration == ITERATIONS + 1
    bs = [v for k, v in _flat(run.state.params).items() if k[-1] == "lora_b"]
    assert len(bs) == len(ALL) and all(np.abs(b).max() > 1e-3 for b in bs)  # the adapters moved off zero
    return run


@pytest.mark.slow
def test_sampler_decodes_the_merged_plain_model(lora_run, model_path):
    run = lora_run
    (g0, p0), _ = load_hf_model(model_path, split=True)
    held, plain = _flat(run.policy.params), _flat(p0)
    assert held.keys() == plain.keys()
    assert all(held[k].shape == plain[k].shape and held[k].dtype == plain[k].dtype for k in plain)
    assert sum(v.nbytes for v in held.values()) == sum(v.nbytes for v in plain.values())
    assert not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(run.policy.params))
    assert run.decode_graphdef == g0 and all(s.graphdef == g0 for s in run.policy.samplers.values())
    assert run.graphdef != g0  # the train graphdef has the adapters
    changed = [k for k in plain if not np.array_equal(held[k], plain[k])]
    assert len(changed) == len(ALL) and all(k[-1] == "kernel" for k in changed)  # the adapters merged in

    run.set_temperature(0.0)
    run.policy.reseed(0)
    gens = run.policy.generate(PROMPTS, "action")
    seqs = [np.concatenate([gen.prompt_ids, gen.response_ids]) for gen in gens]
    width = max(map(len, seqs))
    tokens = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros((len(seqs), width), bool)
    for i, s in enumerate(seqs):  # left-padded, as the scoring pads
        tokens[i, width - len(s) :], mask[i, width - len(s) :] = s, True
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    ours = _logits(run.graphdef, run.state.model_params, tokens, pos, mask)  # unmerged LoRA model
    base = _logits(run.graphdef, run.reference_params(), tokens, pos, mask)
    # the reference policy is the base model (up to the 8-device mesh's reduction order)
    assert np.abs(base - _logits(g0, p0, tokens, pos, mask)).max() <= 1e-6 * np.abs(base).max()

    def log_softmax(x):
        x = x.astype(np.float64)
        return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))

    lp, lp_base = log_softmax(ours), log_softmax(base)
    n_tokens, base_gap = 0, 0.0
    for i, gen in enumerate(gens):
        start = width - len(seqs[i]) + len(gen.prompt_ids) - 1  # the column that predicts response token 0
        for j, tok in enumerate(gen.response_ids):
            row = lp[i, start + j]
            top2 = np.sort(row)[-2:]
            if top2[1] - top2[0] > 1e-4:
                assert tok == row.argmax(), (i, j)
            assert gen.logprobs[j] == pytest.approx(row[tok], abs=1e-4), (i, j)
            base_gap = max(base_gap, abs(lp_base[i, start + j, tok] - row[tok]))
            n_tokens += 1
    assert n_tokens >= 8 and base_gap > 1e-2  # the base model would not have written these log-probs


@pytest.fixture(scope="module")
def exported(straight, model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "out"
    launch("export", *_flags(model_path), "--workdir", str(straight), "--out", str(out))
    return out


@pytest.mark.slow
def test_export_merged_and_peft_adapter_give_our_logits(lora_run, exported, model_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    run = lora_run
    assert run.mcfg.qkv_bias  # qwen2: the base's q / k / v biases go through the export and peft too
    info = json.loads((exported / "adapter" / "adapter_config.json").read_text())
    assert info["base_model_name_or_path"] == str(model_path) and info["r"] == 4
    assert sorted(info["target_modules"]) == sorted(HF_NAME.values())
    tokens, pos, mask = _batch(run.mcfg.vocab_size)
    ours = _logits(run.graphdef, run.state.model_params, tokens, pos, mask)[mask]
    base = _logits(run.graphdef, run.reference_params(), tokens, pos, mask)[mask]
    tol = 1e-4 * np.abs(ours).max()
    assert np.abs(ours - base).max() > 100 * tol  # the adapters matter far beyond the tolerance

    def torch_logits(model):
        with torch.no_grad():
            out = model(
                input_ids=torch.tensor(tokens, dtype=torch.long),
                attention_mask=torch.tensor(mask.astype(np.int64)),
                position_ids=torch.tensor(pos, dtype=torch.long),
            ).logits.numpy()
        return out[mask]

    merged = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    assert np.abs(torch_logits(merged) - ours).max() <= tol
    hf_base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    assert np.abs(torch_logits(hf_base) - base).max() <= tol
    adapted = peft.PeftModel.from_pretrained(hf_base, str(exported / "adapter")).eval()
    assert np.abs(torch_logits(adapted) - ours).max() <= tol


@pytest.mark.slow
def test_resume_is_exact_and_checkpoints_hold_adapters_only(straight, model_path, tmp_path):
    killed = tmp_path / "killed"
    shutil.copytree(straight, killed)
    shutil.rmtree(killed / "checkpoints" / "2")  # killed after iteration 1's checkpoint
    launch(*_flags(model_path), "--workdir", str(killed))
    _compare_rows(metrics(killed), metrics(straight))
    assert [r["iteration"] for r in metrics(killed)] == [1, 2]
    got, want = _saved(killed / "checkpoints", 2), _saved(straight / "checkpoints", 2)
    assert got.keys() == want.keys()
    assert _max_diff(got, want) < 1e-6

    cfg = ModelConfig.from_hf(load_hf_config(model_path), lora_rank=4)
    n = memory.num_lora_params(cfg)
    params = {k: v for k, v in want.items() if k[0] == "params"}
    assert params and all(_is_adapter(k) for k in params) and sum(v.size for v in params.values()) == n
    floats = sum(v.size for v in want.values() if np.issubdtype(v.dtype, np.floating))
    assert floats == 3 * n  # the adapters and their two moments: no base weight
    assert 3 * n < memory.num_params(cfg) / 4


@pytest.mark.slow
def test_population_of_adapters_equals_separate_runs(straight, model_path, tmp_path):
    from rollout import population

    values = [0.1, 0.4]
    assert float(_config(model_path).algo.invalid_penalty) == values[0]  # the straight run is copy 0
    separate = {0.1: straight, 0.4: tmp_path / "sep_0.4"}
    launch(*_flags(model_path, "--config.algo.invalid_penalty=0.4"), "--workdir", str(separate[0.4]))
    work = tmp_path / "pop"
    launch("ablate", "--train", *_flags(model_path), "--grid", GRID, "--workdir", str(work))
    stacked = _saved(work / "population_checkpoints", 2)
    runs = [_saved(separate[v] / "checkpoints", 2) for v in values]
    assert stacked.keys() == runs[0].keys()
    params = {k: v for k, v in stacked.items() if k[0] == "params"}
    assert params and all(_is_adapter(k) and v.shape == (2, *runs[0][k].shape) for k, v in params.items())
    spread = _max_diff({k: runs[0][k] for k in params}, {k: runs[1][k] for k in params})
    assert spread > 1e-4  # the copies really differ, by far more than the tolerance below
    for k, v in enumerate(values):
        mine = {p: x[k] for p, x in stacked.items()}
        for part in ("params", "opt_state"):
            keys = [p for p in mine if p[0] == part]
            assert _max_diff({p: mine[p] for p in keys}, {p: runs[k][p] for p in keys}) < 1e-5, part
        for p in (("step",), ("rng",), ("skipped",)):
            np.testing.assert_array_equal(mine[p], runs[k][p])
        label = population.copy_label({"invalid_penalty": v})
        _compare_rows(metrics(work / "copies" / label), metrics(separate[v]))
