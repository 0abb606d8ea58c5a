"""Where an invalid step's penalty lands (RolloutConfig.penalty_tokens, ALGORITHMS.md 0 with our
choice): on the wrong command's tokens only, not on the <think>/<action> format every step shares.

Hand cases with the scripted policy, whose tokens are whitespace words (so the content tokens are
known by position): an inadmissible command penalises exactly its words, a format error the whole
response, and the gathered per-token advantages put (base - penalty) on those tokens and the base
advantage on the rest of the row.
"""

import numpy as np
import pytest

from rollout.collect import RolloutConfig, collect, penalty_token_mask
from rollout.parsing import INADMISSIBLE, MISSING_TAG, action_content_span
from rollout.policy import ScriptedPolicy
from tests.test_collect import Corridor

WRONG = "<think> go on </think> <action> fly high </action>"  # words 5, 6 are the command
RIGHT = "<think> go on </think> <action> forward </action>"
NO_TAG = "just forward"


def test_action_content_span():
    text = "<think>x</think><action>  go to desk 1 </action>"
    a, b = action_content_span(text)
    assert text[a:b] == "go to desk 1"
    assert action_content_span("<action></action>") is None
    assert action_content_span("<action>a</action><action>b</action>") is None
    assert action_content_span("no tags") is None


def _gen(text):
    pol = ScriptedPolicy(lambda *_: text)
    return pol, pol.generate([[{"role": "user", "content": "q"}]], "action")[0]


def test_mask_covers_the_command_words_only():
    pol, g = _gen(WRONG)
    assert penalty_token_mask(g, INADMISSIBLE, pol.decode, "action").tolist() == [0, 0, 0, 0, 0, 1, 1, 0]
    assert penalty_token_mask(g, INADMISSIBLE, pol.decode, "response").all()
    pol, g = _gen(NO_TAG)
    assert penalty_token_mask(g, MISSING_TAG, pol.decode, "action").all()  # the format was wrong
    with pytest.raises(ValueError, match="decode"):
        penalty_token_mask(_gen(WRONG)[1], INADMISSIBLE, None, "action")


ROOM = ["go to cabinet 1", "go to cabinet 2", "go to desk 1", "take pen 1 from desk 1", "look"]


@pytest.mark.parametrize(
    "text, wrong",
    [
        # words: 0 <think> 1 go 2 on 3 </think> 4 <action> 5.. the command, then </action>
        ("<think> go on </think> <action> go to cabinet 3 </action>", 8),  # "3": no cabinet 3 here
        ("<think> go on </think> <action> go to sofa 1 </action>", 7),  # "sofa": no sofa
        ("<think> go on </think> <action> fly to desk 1 </action>", 5),  # the first word already
        ("<think> go on </think> <action> take pen 1 from cabinet 1 </action>", 9),  # right until "cabinet"
        ("<think> go on </think> <action> GO To cabinet 7 </action>", 8),  # case does not matter: "7"
        ("<think> go on </think> <action> go to cabinet </action>", 8),  # cut short: the closing tag
    ],
)
def test_divergence_mask_is_the_first_wrong_token(text, wrong):
    pol, g = _gen(text)
    mask = penalty_token_mask(g, INADMISSIBLE, pol.decode, "divergence", ROOM)
    assert np.flatnonzero(mask).tolist() == [wrong]
    # "action" covers the whole command, and "divergence" one token of it (or the tag after it)
    action = penalty_token_mask(g, INADMISSIBLE, pol.decode, "action", ROOM)
    assert action[wrong] or wrong == len(text.split()) - 1


def test_divergence_falls_back_to_the_command_without_a_list_or_for_a_format_error():
    pol, g = _gen(WRONG)
    assert penalty_token_mask(g, INADMISSIBLE, pol.decode, "divergence", None).tolist() == [0, 0, 0, 0, 0, 1, 1, 0]
    pol, g = _gen(NO_TAG)
    assert penalty_token_mask(g, MISSING_TAG, pol.decode, "divergence", ROOM).all()


@pytest.mark.parametrize("mode", ["action", "divergence", "response"])
def test_gathered_advantages_put_the_penalty_on_the_masked_tokens(mode):
    from strata_jax.advantages import AdvantageParams, compute_advantages, invalid_penalty
    from strata_jax.batch import gather_advantages

    # task 0 (goal room 2): trajectory 0 walks straight there; trajectory 1 first sends a wrong
    # command, then walks; both win in 2 / 3 steps. Trajectory 2 waits and loses.
    script = {0: [RIGHT, RIGHT], 1: [WRONG, RIGHT, RIGHT], 2: [NO_TAG] * 4}
    pol = ScriptedPolicy(lambda msgs, kind, key: script[key[2]][key[3]] if kind == "action" else "")
    cfg = RolloutConfig(mode="flat", group_size=3, max_steps=4, judgment=False, progress=False, penalty_tokens=mode)
    res = collect([Corridor(max_steps=4) for _ in range(3)], pol, [0], cfg)
    params = AdvantageParams(invalid_penalty=0.5)
    adv = compute_advantages(res.traj, params, "grpo")
    tb = gather_advantages(adv.step, adv.strategy, res.tokens, invalid_penalty(res.traj, params))
    a, lm, pm = (np.asarray(x) for x in (tb.advantage, tb.loss_mask, tb.penalty_mask))
    step = np.asarray(adv.step)
    for s, (p, n, m, t) in enumerate(np.asarray(tb.row_index)):
        if not tb.row_valid[s]:
            continue
        row, on = a[s][lm[s]], pm[s][lm[s]]
        invalid = bool(res.traj.invalid[p, n, m, t])
        base = step[p, n, m, t] + 0.5 * invalid
        if not invalid:
            assert not on.any() and np.allclose(row, base)
            continue
        if mode == "action" and m == 1:  # the inadmissible command: its two words, nothing else
            assert on.tolist() == [0, 0, 0, 0, 0, 1, 1, 0]
        elif mode == "divergence" and m == 1:  # "fly": no corridor command starts with it
            assert on.tolist() == [0, 0, 0, 0, 0, 1, 0, 0]
        else:  # a format error, or mode "response": the whole response
            assert on.all()
        np.testing.assert_allclose(row[on], base - 0.5, atol=1e-6)
        np.testing.assert_allclose(row[~on], base, atol=1e-6)
    # without the mask (or the penalty) every token carries the full step advantage, as before
    plain = gather_advantages(
        adv.step, adv.strategy, res.tokens.replace(penalty_mask=None), invalid_penalty(res.traj, params)
    )
    for s, (p, n, m, t) in enumerate(np.asarray(tb.row_index)):
        if tb.row_valid[s]:
            assert np.allclose(np.asarray(plain.advantage)[s][lm[s]], step[p, n, m, t])
