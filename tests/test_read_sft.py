"""The SFT reading phase (config.sft.read_steps): which answer tokens it trains, hand-checked, and
that it makes a tiny model read the signpost's colour where whole-answer SFT does not."""

import numpy as np
import pytest

from strata_jax.sft import read_token_weights

STEPS = 200  # whole-answer SFT steps after the reading phase (at 2e-3 it keeps what that phase read)


def test_read_weights_mark_copied_content_words_by_hand():
    # Two kinds of call (responses starting with 7 and with 9). Among the 7s, token 1 is in all
    # four contexts (template: never read), 2 in two of four (content), 3 in one.
    contexts = [[1, 2, 5], [1, 2], [1, 3], [1, 4], [1, 2, 3, 4]]
    responses = [[7, 1, 2, 5], [7, 2, 3], [7, 3, 1], [7, 4, 4, 2], [9, 2, 3, 4, 9]]
    got = read_token_weights(contexts, responses, max_share=0.5)
    # 7-kind contexts: 1 in 4/4 (out), 2 in 2/4, 3 in 1/4, 4 in 1/4, 5 in 1/4 (all in)
    want = [
        [0, 0, 1, 1],  # 5 is copied from this row's own context
        [0, 1, 0],  # 3 is content but not in this row's context
        [0, 1, 0],
        [0, 1, 1, 0],  # 2 is content, but not in this context
        [0, 0, 0, 0, 0],
    ]  # the 9-kind has one context: every token is in 1/1 > 0.5
    assert [w.tolist() for w in got] == want
    assert all(w.dtype == np.float32 for w in got)
    # a looser share keeps the one-context kind's words
    assert read_token_weights(contexts, responses, max_share=1.0)[4].tolist() == [0, 1, 1, 1, 0]
    with pytest.raises(ValueError, match="2 contexts, 1 responses"):
        read_token_weights([[1], [2]], [[1]])


@pytest.fixture(scope="module")
def signs(tmp_path_factory):
    """A signpost corridor (4 doors, 6 colours, the sign at door 3) and its tiny model."""
    from configs.tiny_doors import doors
    from rollout.demos import corpus
    from strata_jax.models.hf import load_tokenizer
    from strata_jax.models.tiny import make_tiny_model

    c = doors("strata")
    c.env.doors_options, c.env.doors_sign_at = 6, 2
    c.env.horizon_min = c.env.horizon_max = c.env.max_steps = 4
    path = tmp_path_factory.mktemp("signs") / "init"
    m = c.model
    make_tiny_model(
        path,
        texts=corpus(c),
        vocab_size=int(m.tiny_vocab),
        hidden_size=int(m.tiny_hidden),
        layers=int(m.tiny_layers),
        heads=int(m.tiny_heads),
        kv_heads=int(m.tiny_kv_heads),
        intermediate_size=int(m.tiny_intermediate),
        seed=0,
    )
    return c, path, load_tokenizer(path)


def test_context_is_task_strategy_and_observation_without_the_options(signs):
    from rollout.demos import DOORS_STRATEGY
    from rollout.policy import render
    from rollout.prompts import step_prompt
    from rollout.warmstart import context_tokens

    _, _, tok = signs
    obs = "You are at door 3 of 4. A sign here reads: black. From this door on, only that colour opens."
    msgs = step_prompt(
        "go through every door.",
        obs,
        ["open the red door", "open the white door"],
        strategy=DOORS_STRATEGY,
        step=2,
        history_length=0,
    )
    ids = np.asarray(tok.encode(render(msgs, tok), add_special_tokens=False))
    text = tok.decode(list(context_tokens(ids, tok)))
    assert text.startswith("Your task is to: go through every door.")
    assert DOORS_STRATEGY in text and obs in text
    assert "white" not in text and "Admissible" not in text and "You are an agent" not in text
    # no markers: the whole prompt
    plain = np.asarray(tok.encode("open the white door", add_special_tokens=False))
    assert context_tokens(plain, tok).tolist() == plain.tolist()


def test_signpost_rows_read_the_signs_colour_and_nothing_the_template_gives(signs):
    """On the corridor, the words an answer copies from its prompt are the sign's colour at its
    door and the colour a revised strategy carries; never red (no prompt names it) nor `door`."""
    from rollout.demos import sft_rows
    from rollout.envs.doors import COLORS
    from rollout.warmstart import context_tokens

    c, _, tok = signs
    rows = sft_rows(c, tok, range(64), 1.0)
    w = read_token_weights([context_tokens(p, tok) for p, _ in rows], [r for _, r in rows])
    read = [tok.decode([int(t)]).strip() for (_, r), x in zip(rows, w) for t in r[x > 0]]
    assert set(read) <= set(COLORS[1:6]) and len(set(read)) == 5
    at_sign = [
        (p, r, x)
        for (p, r), x in zip(rows, w)
        if "A sign here reads" in tok.decode(list(p)) and "<action>" in tok.decode(list(r))
    ]
    assert len(at_sign) == 128  # 64 tasks, both prompt styles
    for p, r, x in at_sign:  # the one word marked is the sign's colour
        colour = tok.decode(list(p)).split("reads: ")[1].split(".")[0]
        assert x.sum() == 1 and tok.decode([int(r[x > 0][0])]).strip() == colour


def _probe():
    from tests.bench_modules import load_bench

    return load_bench("read_probe").probe


@pytest.mark.slow
@pytest.mark.parametrize("read_steps", [200, 0])
def test_the_reading_phase_makes_the_model_read_the_sign(signs, tmp_path, read_steps):
    """The same SFT with and without the reading phase, scored by bench/read_probe.py (the sign's
    colour at its door, held-out corridors, chance 0.2): only the reading phase reads it."""
    import copy

    from rollout.setup import make_mesh
    from rollout.warmstart import run_sft

    base, init, _ = signs
    c = copy.deepcopy(base)
    c.sft.num_tasks, c.sft.steps, c.sft.lr = 64, STEPS, 2e-3
    c.sft.read_steps, c.log.progress = read_steps, False
    run_sft(c, init, tmp_path / "sft", make_mesh(c))
    got = _probe()(str(tmp_path / "sft"), doors=4, options=6, sign_at=2, tasks=20)
    if read_steps:  # measured: p 0.82, argmax right on all 40 prompts
        assert got["p_right"] > 0.6 and got["argmax_right"] > 0.8, got
    else:  # the whole-answer loss learns the template, not the sign (measured: p 0.10, argmax never right)
        assert got["p_right"] < 0.35 and got["argmax_right"] < 0.5, got
