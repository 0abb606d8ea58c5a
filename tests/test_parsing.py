"""Parsers: hand-written expectations per case, and totality (never raise) on arbitrary text."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from rollout.parsing import (
    EMPTY,
    INADMISSIBLE,
    MISSING_TAG,
    MULTIPLE,
    TOO_LONG,
    ParsedAction,
    normalize_action,
    parse_action,
    parse_bad_steps,
    parse_strategy,
)

ADM = ["go to fridge 1", "take apple 1 from countertop 2", "look"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>the apple is cold</think><action>go to fridge 1</action>", ParsedAction("go to fridge 1", True, None)),
        (
            "<action>  Take   Apple 1 FROM countertop 2\n</action>",
            ParsedAction("take apple 1 from countertop 2", True, None),
        ),
        ("<ACTION>look</ACTION>", ParsedAction("look", True, None)),
        ("go to fridge 1", ParsedAction("", False, MISSING_TAG)),
        ("<action>go to fridge 1", ParsedAction("", False, MISSING_TAG)),
        ("go to fridge 1</action>", ParsedAction("", False, MISSING_TAG)),
        ("<action>   </action>", ParsedAction("", False, EMPTY)),
        ("<action>look</action><action>look</action>", ParsedAction("", False, MULTIPLE)),
        ("<action>look</action> and <action>", ParsedAction("", False, MULTIPLE)),
        ("<action>go to fridge 2</action>", ParsedAction("", False, INADMISSIBLE)),
        ("<action>" + "look " * 100 + "</action>", ParsedAction("", False, TOO_LONG)),
    ],
)
def test_parse_action_cases(text, expected):
    assert parse_action(text, ADM) == expected


def test_parse_action_returns_env_spelling_and_accepts_any_without_list():
    assert parse_action("<action>go to Fridge 1</action>", ["Go To Fridge 1"]).action == "Go To Fridge 1"
    assert parse_action("<action> Open  the Door </action>", None) == ParsedAction("open the door", True, None)
    assert normalize_action("  A \t b\nC ") == "a b c"


@pytest.mark.parametrize(
    "text, budget, expected",
    [
        ("<strategy>Find the apple,  then\ncool it.</strategy>", None, ("Find the apple, then cool it.", False)),
        ("<think>hm</think><strategy>a b c d</strategy>", 2, ("a b", False)),
        ("just go to the fridge", None, ("just go to the fridge", True)),
        ("<strategy>   </strategy>", None, ("", True)),
        ("<strategy>one</strategy><strategy>two</strategy>", None, ("one two", True)),
        ("<strategy>unfinished plan", None, ("unfinished plan", True)),
    ],
)
def test_parse_strategy_cases(text, budget, expected):
    assert parse_strategy(text, budget) == expected


@pytest.mark.parametrize(
    "text, n, expected",
    [
        ("<bad_steps>2, 5</bad_steps>", 5, ({2, 5}, True)),
        ("<bad_steps>none</bad_steps>", 5, (set(), True)),
        ("<bad_steps> None. </bad_steps>", 5, (set(), True)),
        ("<bad_steps></bad_steps>", 3, (set(), True)),
        ("<bad_steps>step 1 and step 3</bad_steps>", 3, ({1, 3}, True)),
        ("<bad_steps>[1;2]</bad_steps>", 3, ({1, 2}, True)),
        ("<bad_steps>3 3</bad_steps>", 3, ({3}, True)),
        ("<bad_steps>4</bad_steps>", 3, (set(), False)),  # out of range
        ("<bad_steps>0</bad_steps>", 3, (set(), False)),
        ("<bad_steps>the second one</bad_steps>", 3, (set(), False)),
        ("<bad_steps>-1</bad_steps>", 3, (set(), False)),
        ("steps 1 and 2 were bad", 3, (set(), False)),  # no tag
        ("<bad_steps>1</bad_steps><bad_steps>2</bad_steps>", 3, (set(), False)),
        ("<bad_steps>" + "9" * 5000 + "</bad_steps>", 3, (set(), False)),  # int() would raise
    ],
)
def test_parse_bad_steps_cases(text, n, expected):
    assert parse_bad_steps(text, n) == expected


_tags = hs.sampled_from(
    [
        "<action>",
        "</action>",
        "<strategy>",
        "</strategy>",
        "<bad_steps>",
        "</bad_steps>",
        "<think>",
        "none",
        "1",
        ",",
        " ",
        "look",
        "99999999",
    ]
)
_texts = hs.one_of(hs.text(max_size=300), hs.lists(hs.one_of(_tags, hs.text(max_size=5)), max_size=30).map("".join))


@settings(max_examples=300, deadline=None)
@given(_texts, hs.integers(-2, 40))
def test_parsers_never_raise(text, n):
    pa = parse_action(text, ADM)
    assert pa.valid == (pa.reason is None)
    assert pa.valid == (pa.action in ADM)
    z, malformed = parse_strategy(text, 8)
    assert isinstance(z, str) and len(z.split()) <= 8
    bad, ok = parse_bad_steps(text, n)
    assert all(1 <= k <= n for k in bad) and (ok or not bad)
