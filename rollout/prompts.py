"""Prompt builders: the strategy prompt, the non-cumulative step prompt, the self-judgment prompt.

Each returns a list of chat messages ([{"role": "user", "content": ...}]); rendering with a
tokenizer's chat template happens in the policy (`rollout.policy.render`). One user message and
no system message, so any chat template (including ones without a system role) accepts it.

Step prompts are non-cumulative (ALGORITHMS 3.1): the current observation, the task line, the
admissible actions and at most `history_length` recent steps, with the strategy z prepended. The
prompt length therefore stays bounded however long the episode runs.

(choice) From the second step on, a step prompt also repeats what the agent saw at the start (the
first observation, without its banner and task line: the room's receptacles, and in the household
world with `reveal_objects` where the task's objects are). With a short history that first
observation is otherwise gone from step 3 on, and an agent without a strategy to carry it (GRPO,
GiGPO, BEACON) cannot know where to go: every medium and long task was unsolvable by design.
`env.show_first_observation = False` turns it off.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

Messages = list[dict[str, str]]

FIRST_OBS_CHARS = 600  # the first observation, repeated as memory (ALFWorld's room lists fit)
HISTORY_OBS_CHARS = 300  # recent steps are context, not the state: keep them short
OBS_CHARS = 4000  # bound on the current observation (ALFWorld's are well under this)
STRATEGY_WORDS = 60  # the plan length the strategy prompt asks for
INTRO = "You are an agent in a text-based household environment."


def _user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


def _clip(text: str, n: int) -> str:
    """Whitespace-collapsed text cut to n characters (with an ellipsis when cut)."""
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: max(n - 3, 0)] + "..."


def _cut(text: str, n: int) -> str:
    """Stripped text cut to n characters; the current observation keeps its line structure."""
    text = str(text).strip()
    return text if len(text) <= n else text[: max(n - 3, 0)] + "..."


def _shown_action(action: str) -> str:
    # An invalid output is sent as "" (the no-op); say so rather than showing an empty string.
    return action if action else "(no valid action)"


def strategy_prompt(task: str, observation: str, max_words: int = STRATEGY_WORDS, intro: str = INTRO) -> Messages:
    """Ask for a short global plan for the episode, inside <strategy>...</strategy>."""
    return _user(
        f"{intro}\n"
        f"Your task is to: {task}\n"
        f"Initial observation: {_cut(observation, OBS_CHARS)}\n\n"
        "Before acting, write a short, high-level strategy for the whole episode: which places to "
        "search, in what order, and which sub-goals to complete. "
        f"Use at most {max_words} words and no actions list.\n"
        "Answer with the strategy inside <strategy>...</strategy>."
    )


def first_observation_memory(observation: str) -> str:
    """The first observation as a memory line: without TextWorld's welcome banner and without the
    task sentence (the prompt states the task already), whitespace collapsed, clipped."""
    text = str(observation)
    text = re.sub(r"-=.*?=-", " ", text)  # "-= Welcome to TextWorld, ALFRED! =-"
    text = re.split(r"Your task is to:", text, maxsplit=1)[0]
    return _clip(text, FIRST_OBS_CHARS)


def step_prompt(
    task: str,
    observation: str,
    admissible: Sequence[str] | None,
    history: Sequence[tuple[str, str]] = (),
    strategy: str | None = None,
    step: int = 0,
    history_length: int = 2,
    intro: str = INTRO,
    first_observation: str | None = None,
    numbered: bool = False,
) -> Messages:
    """The prompt for step `step` (0-based): task, strategy, start memory, recent steps,
    observation, actions.

    `history` is the list of (observation, action) pairs of the steps taken so far, oldest first;
    only the last `history_length` are shown. `first_observation` (the episode's first
    observation) is repeated as a memory line from step 1 on (at step 0 it is the current one).
    `numbered` (`env.action_format="index"`): the admissible commands are listed as `[k] command`
    and the answer is the number k.
    """
    lines = [intro, f"Your task is to: {task}"]
    if strategy:
        lines.append(f"Your strategy for this episode: {strategy}")
    if first_observation and step > 0:
        memory = first_observation_memory(first_observation)
        if memory:
            lines.append(f"At the start you saw: {memory}")
    recent = list(history)[-history_length:] if history_length > 0 else []
    if recent:
        first = step - len(recent)
        lines.append(f"Your last {len(recent)} step(s):")
        for i, (obs, act) in enumerate(recent):
            lines.append(
                f"[Step {first + i + 1}] Observation: {_clip(obs, HISTORY_OBS_CHARS)} Action: {_shown_action(act)}"
            )
    lines.append(f"Current observation (step {step + 1}): {_cut(observation, OBS_CHARS)}")
    about = "the current situation and your strategy" if strategy else "the current situation"
    if numbered:
        if admissible is None:
            raise ValueError("step_prompt(numbered=True) needs the admissible commands")
        lines.append("Admissible actions: " + " ".join(numbered_list(admissible)))
        lines.append(
            f"First reason about {about} inside <think>...</think>, "
            "then give the number of exactly one admissible action inside <action>...</action>."
        )
        return _user("\n".join(lines))
    if admissible is not None:
        lines.append("Admissible actions: " + ", ".join(f"'{a}'" for a in admissible))
    lines.append(
        f"First reason about {about} inside <think>...</think>, "
        "then give exactly one admissible action inside <action>...</action>."
    )
    return _user("\n".join(lines))


def numbered_list(admissible: Sequence[str]) -> list[str]:
    """`[k] command` for the k-th (1-based) admissible command: the list an index answer refers to."""
    return [f"[{k}] {a}" for k, a in enumerate(admissible, 1)]


_NUMBERED = re.compile(r"\[(\d+)\] ([^\[\n]*?)(?= \[\d+\] |$)", re.MULTILINE)


def numbered_commands(prompt_text: str) -> dict[str, int]:
    """{command: number} of the numbered admissible list in a step prompt's text (the expert
    demonstrator answers by number from the prompt it is shown, as the model must)."""
    line = next((ln for ln in prompt_text.splitlines() if ln.startswith("Admissible actions: [")), "")
    return {m[2].strip(): int(m[1]) for m in _NUMBERED.finditer(line[len("Admissible actions: ") :])}


def judge_prompt(
    task: str, strategy: str | None, steps: Sequence[tuple[str, str]], excerpt_chars: int = 150
) -> Messages:
    """Self-judgment (ALGORITHMS 3.4): list the steps that neither follow z nor advance the task."""
    lines = [f"An agent worked on this task: {task}"]
    lines.append(f"It followed this strategy: {strategy}" if strategy else "It had no explicit strategy.")
    lines.append("Its steps (observation before the step, then the action taken):")
    for i, (obs, act) in enumerate(steps):
        lines.append(f"{i + 1}. Observation: {_clip(obs, excerpt_chars)} | Action: {_shown_action(act)}")
    lines.append(
        "Which steps neither follow the strategy nor advance the task? "
        "List their numbers inside <bad_steps>...</bad_steps>, for example "
        "<bad_steps>2, 5</bad_steps>, or <bad_steps>none</bad_steps> if every step was useful."
    )
    return _user("\n".join(lines))


def revision_prompt(
    task: str,
    observation: str,
    strategy: str | None,
    history: Sequence[tuple[str, str]],
    step: int,
    recent: int,
    max_words: int = STRATEGY_WORDS,
    intro: str = INTRO,
) -> Messages:
    """Strategy revision (docs/CONTRACTS.md): before step `step` (0-based), the agent
    may rewrite its strategy from the strategy in force, its last `recent` steps and the current
    observation. Same answer format as the strategy prompt, so a revision is a strategy sample."""
    lines = [
        intro,
        f"Your task is to: {task}",
        f"Your strategy so far: {strategy}" if strategy else "You had no explicit strategy.",
    ]
    shown = list(history)[-recent:] if recent > 0 else []
    lines.append(f"You have taken {step} step(s). Your last {len(shown)} step(s):")
    first = step - len(shown)
    for i, (obs, act) in enumerate(shown):
        lines.append(
            f"[Step {first + i + 1}] Observation: {_clip(obs, HISTORY_OBS_CHARS)} Action: {_shown_action(act)}"
        )
    lines.append(f"Current observation (step {step + 1}): {_cut(observation, OBS_CHARS)}")
    lines.append(
        "\nRevise your strategy for the rest of the episode given this progress: keep what still "
        "holds and change what does not. "
        f"Use at most {max_words} words and no actions list.\n"
        "Answer with the strategy inside <strategy>...</strategy>."
    )
    return _user("\n".join(lines))
