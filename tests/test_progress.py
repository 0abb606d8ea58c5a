"""rollout/progress.py: tqdm on a terminal; off a terminal (a log file, CI) plain lines at most every
`interval` seconds with rate and ETA, instead of a redraw per update; nothing when switched off.
Timed with a fake clock, never with sleeps."""

import io
import re

import pytest
from tqdm.auto import tqdm

from rollout.collect import RolloutConfig, collect
from rollout.policy import ScriptedPolicy
from rollout.progress import INTERVAL_S, LineBar, NoBar, TtyBar, note, progress
from tests.test_collect import Corridor


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def test_a_log_gets_a_bounded_number_of_lines_for_many_fast_updates():
    out, clock = io.StringIO(), Clock()
    bar = progress(total=10_000, desc="sft", tty=False, file=out, clock=clock, unit="step")
    assert isinstance(bar, LineBar)
    for i in range(10_000):  # 10,000 steps of 5 ms: 50 s
        clock.t += 0.005
        bar.update()
        bar.set_postfix(loss=f"{1.0 / (i + 1):.3f}")
    bar.close()
    lines = _lines(out)
    # one at the start, one per 10 s of the 50 s, one at the end (not repeated by a second close)
    assert len(lines) <= 2 + 50 / INTERVAL_S
    bar.close()
    assert len(_lines(out)) == len(lines)
    assert lines[0].startswith("sft: 0/10000 step (0%)") and "ETA ?" in lines[0]
    mid = lines[1]
    assert re.search(r"sft: \d+/10000 step \(\d+%\), 200 step/s, elapsed 0:10, ETA 0:40 \| loss=", mid), mid
    assert lines[-1].startswith("sft: 10000/10000 step (100%), 200 step/s, elapsed 0:50, ETA 0:00")
    assert "\r" not in out.getvalue()


def test_slow_steps_show_seconds_per_step_and_long_etas_in_hours():
    out, clock = io.StringIO(), Clock()
    bar = progress(total=1000, desc="rollout steps", tty=False, file=out, clock=clock, unit="step")
    clock.t += 20.0
    bar.update()
    assert _lines(out)[-1] == "rollout steps: 1/1000 step (0%), 20 s/step, elapsed 0:20, ETA 5:33:00"


def test_status_prints_a_phase_once_and_iteration_ticks_after_each_item():
    out, clock = io.StringIO(), Clock()
    bar = progress(
        iterable=range(3, 6),
        desc="strata",
        initial=2,
        total=5,
        tty=False,
        file=out,
        clock=clock,
        unit="iter",
        postfix="loading",
    )
    assert _lines(out) == ["strata: 2/5 iter (40%), ? iter/s, elapsed 0:00, ETA ? | loading"]
    seen = []
    for it in bar:
        seen.append((it, bar.n))  # the tick comes after the body, as tqdm's
        bar.status(f"iteration {it}: evaluating")
        bar.status(f"iteration {it}: evaluating")  # unchanged: no second line
        clock.t += 30.0
    assert seen == [(3, 2), (4, 3), (5, 4)]
    lines = _lines(out)
    assert lines[1] == "strata: 2/5 iter (40%), ? iter/s, elapsed 0:00, ETA ? | iteration 3: evaluating"
    assert lines[2] == "strata: 3/5 iter (60%), 30 s/iter, elapsed 0:30, ETA 1:00 | iteration 3: evaluating"
    assert lines[-1] == "strata: 5/5 iter (100%), 30 s/iter, elapsed 1:30, ETA 0:00 | iteration 5: evaluating"
    assert len(lines) == 7  # start, 3 phases, 3 ticks (the last tick is the closing line)


def test_a_terminal_gets_tqdm():
    out = io.StringIO()
    bar = progress(total=50, desc="eval", tty=True, file=out, unit="step", postfix="resetting")
    assert isinstance(bar, TtyBar) and isinstance(bar, tqdm)
    for _ in range(50):
        bar.update()
    bar.set_postfix(loss="0.5")
    bar.status("judging")
    bar.close()
    text = out.getvalue()
    assert bar.n == 50 and "\r" in text and "eval" in text and "50/50" in text and "step/s" in text
    assert "judging" in text


def test_switched_off_prints_nothing(capsys):
    bar = progress(total=5, desc="x", enabled=False)
    assert isinstance(bar, NoBar)
    with bar:
        bar.update(3)
        bar.set_postfix(a=1)
        bar.status("phase")
        bar.write("hidden")
    assert list(progress(iterable=[1, 2], enabled=False)) == [1, 2]
    note("hidden", enabled=False)
    assert capsys.readouterr() == ("", "")


def test_notes_and_the_default_stream_off_a_terminal(capsys):
    note("evaluating 8 held-out tasks")
    bar = progress(total=2, desc="steps")  # stderr is captured here: not a terminal
    assert isinstance(bar, LineBar)
    bar.update(2)
    bar.close()
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "evaluating 8 held-out tasks"
    assert err[1].startswith("steps: 0/2 it") and err[-1].startswith("steps: 2/2 it (100%)")


@pytest.mark.parametrize("shown", [True, False])
def test_a_rollout_shows_its_steps_from_the_resets_on(capsys, shown):
    right = "<think> go on </think> <action> forward </action>"
    pol = ScriptedPolicy(lambda msgs, kind, key: right if kind == "action" else "")
    cfg = RolloutConfig(mode="flat", group_size=3, max_steps=4, judgment=False, progress=shown)
    collect([Corridor(max_steps=4) for _ in range(3)], pol, [0], cfg)
    err = capsys.readouterr().err.splitlines()
    if not shown:
        assert err == []
        return
    assert err[0] == "rollout steps: 0/4 step (0%), ? step/s, elapsed 0:00, ETA ? | resetting 3 episodes of 1 tasks"
    assert err[1].startswith("rollout steps: 0/4 step (0%)") and err[1].endswith("| 3 episodes running")
    # the corridor's goal is 2 rooms away; fast steps: no line between the phases and the last
    assert err[2].startswith("rollout steps: 2/4 step (50%)") and err[2].endswith("| running=0")
    assert len(err) == 3
