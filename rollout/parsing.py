"""Parsers for model output: actions, strategies, self-judgment answers.

Every parser here is total: any string (including garbage, huge or unicode input) gives a result
and a reason, never an exception, because model output is untrusted and a raised parse error
would stop a rollout. Tags are matched case-insensitively.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# Reasons an action output is invalid (used as stats keys: "invalid/<reason>").
MISSING_TAG = "missing_tag"
EMPTY = "empty"
MULTIPLE = "multiple"
INADMISSIBLE = "inadmissible"
TOO_LONG = "too_long"
INVALID_REASONS = (MISSING_TAG, EMPTY, MULTIPLE, INADMISSIBLE, TOO_LONG)

MAX_ACTION_CHARS = 200  # admissible commands are short; longer content is rambling, not an action
_MAX_INT_DIGITS = 6  # int() of a huge digit string is slow / raises past 4300 digits

_WS = re.compile(r"\s+")


def _tag_re(tag: str) -> tuple[re.Pattern, re.Pattern]:
    # Non-greedy span, DOTALL so content may span lines; the open-tag regex counts occurrences.
    return (re.compile(rf"<{tag}>(.*?)</{tag}>", re.IGNORECASE | re.DOTALL), re.compile(rf"<{tag}>", re.IGNORECASE))


_ACTION, _ACTION_OPEN = _tag_re("action")
_STRATEGY, _STRATEGY_OPEN = _tag_re("strategy")
_BAD, _BAD_OPEN = _tag_re("bad_steps")
_ANY_TAG = re.compile(r"</?[a-zA-Z_]+>")
# An admissible entry `verb[<placeholder>]` is a template (WebShop's `search[<your query>]`):
# any `verb[...]` with non-empty content matches it.
_TEMPLATE = re.compile(r"^\s*(\w+)\[<[^>]*>\]\s*$")


def normalize_action(text: str) -> str:
    """Strip, lowercase, collapse internal whitespace to one space."""
    return _WS.sub(" ", str(text)).strip().lower()


@dataclass(frozen=True)
class ParsedAction:
    action: str  # the command to send ("" when invalid: the env's no-op)
    valid: bool
    reason: str | None  # one of INVALID_REASONS when invalid, else None


def _single_tag(text: str, full: re.Pattern, open_: re.Pattern) -> tuple[str | None, str | None]:
    """Content of exactly one <tag>...</tag>, or (None, reason)."""
    n_open = len(open_.findall(text))  # counted first: one regex scan, no quadratic search
    if n_open > 1:
        return None, MULTIPLE
    m = full.search(text) if n_open == 1 else None
    if m is None:
        return None, MISSING_TAG
    return m.group(1), None


def parse_action(
    text: str, admissible: Sequence[str] | None, max_chars: int = MAX_ACTION_CHARS, by_index: bool = False
) -> ParsedAction:
    """The single `<action>` of `text`, normalised and checked against `admissible`.

    `by_index` (`env.action_format="index"`): the content must be the 1-based number of a command
    in `admissible` (the prompt's numbered list), and that command is returned; anything else,
    a command's text included, is inadmissible.

    Returns the admissible command as the environment spells it (so the env gets its own string).
    `admissible=None` accepts any non-empty action (environments without a command list). An
    admissible template `verb[<...>]` accepts any `verb[non-empty text]`, returned as normalised.
    """
    if not isinstance(text, str):
        return ParsedAction("", False, MISSING_TAG)
    content, reason = _single_tag(text, _ACTION, _ACTION_OPEN)
    if content is None:
        return ParsedAction("", False, reason)
    if len(content) > 4 * max_chars:  # bound the normalisation work on pathological content
        return ParsedAction("", False, TOO_LONG)
    action = normalize_action(content)
    if not action:
        return ParsedAction("", False, EMPTY)
    if len(action) > max_chars:
        return ParsedAction("", False, TOO_LONG)
    if by_index:
        if admissible is None:
            raise ValueError("parse_action(by_index=True) needs the admissible list the numbers refer to")
        if action.isdigit() and len(action) <= _MAX_INT_DIGITS and 1 <= int(action) <= len(admissible):
            return ParsedAction(admissible[int(action) - 1], True, None)
        return ParsedAction("", False, INADMISSIBLE)
    if admissible is None:
        return ParsedAction(action, True, None)
    if action in admissible:  # fast path: environments list their commands normalised already
        return ParsedAction(action, True, None)
    for cmd in admissible:
        if normalize_action(cmd) == action:
            return ParsedAction(cmd, True, None)
        m = _TEMPLATE.match(cmd)
        if m and action.startswith(m[1].lower() + "[") and action.endswith("]") and action[len(m[1]) + 1 : -1].strip():
            return ParsedAction(action, True, None)
    return ParsedAction("", False, INADMISSIBLE)


def action_content_span(text: str) -> tuple[int, int] | None:
    """Character span [start, end) of the content of the single `<action>...</action>` in `text`
    (whitespace trimmed), or None when there is no single tag or its content is blank: then the
    format itself was wrong, not the command."""
    if not isinstance(text, str) or len(_ACTION_OPEN.findall(text)) != 1:
        return None
    m = _ACTION.search(text)
    if m is None:
        return None
    start, end = m.span(1)
    body = text[start:end]
    lead = len(body) - len(body.lstrip())
    stripped = body.strip()
    if not stripped:
        return None
    return start + lead, start + lead + len(stripped)


def parse_strategy(text: str, budget_tokens: int | None = None) -> tuple[str, bool]:
    """(strategy z, malformed).

    Well-formed = exactly one non-empty `<strategy>...</strategy>`. A malformed answer still
    conditions its episode (the policy said *something*): z is then the text with tags removed,
    and the c_fmt penalty applies. With `budget_tokens`, z is cut to that many whitespace words so
    step prompts stay bounded; length itself is penalised by the advantage code, not here.
    """
    if not isinstance(text, str):
        return "", True
    content, _ = _single_tag(text, _STRATEGY, _STRATEGY_OPEN)
    malformed = content is None or not content.strip()
    z = _ANY_TAG.sub(" ", text if malformed else content)
    words = z.split()
    if budget_tokens is not None and budget_tokens >= 0:
        words = words[:budget_tokens]
    return " ".join(words), malformed


_NONE_WORDS = {"none", "no", "nothing", "n/a", "na", "null", "empty", "-", "[]"}
_STEP_WORD = re.compile(r"\bsteps?\b|#", re.IGNORECASE)  # "step 2, #5" -> "2, 5"
_STEP_ITEM = re.compile(r"^(\d+)\.?$")
_SPLIT = re.compile(r"(?:\s*[,;]\s*|\s+and\s+|\s+)", re.IGNORECASE)


def parse_bad_steps(text: str, n_steps: int) -> tuple[set[int], bool]:
    """(set of 1-based bad step numbers, ok) from `<bad_steps>2, 5</bad_steps>`.

    'none' (or an empty tag) -> (set(), True). Anything else that is not a list of integers in
    [1, n_steps] (missing / repeated tag, words, out-of-range numbers) -> (set(), False): a judge
    that cannot be read penalises nothing and is counted as a parse failure.
    """
    if not isinstance(text, str):
        return set(), False
    content, _ = _single_tag(text, _BAD, _BAD_OPEN)
    if content is None or len(content) > 20 * max(n_steps, 1) + 64:
        return set(), False
    body = content.strip().strip("[](){}.").strip()
    if not body or body.lower() in _NONE_WORDS:
        return set(), True
    steps = set()
    for item in _SPLIT.split(_STEP_WORD.sub(" ", body).strip()):
        if not item:
            continue
        m = _STEP_ITEM.match(item)
        if m is None or len(m.group(1)) > _MAX_INT_DIGITS:
            return set(), False
        k = int(m.group(1))
        if not 1 <= k <= n_steps:
            return set(), False
        steps.add(k)
    return steps, True
