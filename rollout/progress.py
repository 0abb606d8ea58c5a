"""Progress of everything a user waits on (training iterations, rollouts, evaluations, SFT steps).

    bar = progress(total=steps, desc="sft", enabled=config.log.progress, unit="step")
    for _ in range(steps):
        ...
        bar.update()
        bar.set_postfix(loss=f"{loss:.3f}")
    bar.close()

    for it in progress(iterable=range(1, n + 1), desc="strata", enabled=...):  # or iterate

On a terminal (stderr is a TTY) the bar is tqdm's: redrawn in place, with rate and ETA. Anywhere
else (a log file, CI, a captured stream) every tqdm redraw would be a new line in the file, so the
bar prints one plain line when it starts, then at most one every `interval` seconds (10 s by
default), and one when it closes:

    sft: 120/500 step (24%), 3.91 step/s, elapsed 0:31, ETA 1:37 | loss=1.234

`enabled=False` (config.log.progress off) prints nothing at all. `status(text)` names the phase
being waited on (on a terminal the postfix; in a log, a line at once when the text changes), and
`note(text)` prints a message line that does not break a terminal bar.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

from tqdm.auto import tqdm

INTERVAL_S = 10.0  # seconds between two lines of a bar that is not on a terminal


def is_tty(file: Any) -> bool:
    """Whether `file` is a terminal (False for anything without a working isatty)."""
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def progress(
    total: int | None = None,
    desc: str = "",
    enabled: bool = True,
    *,
    iterable: Iterable | None = None,
    initial: int = 0,
    unit: str = "it",
    leave: bool = True,
    postfix: str = "",
    interval: float = INTERVAL_S,
    file: TextIO | None = None,
    tty: bool | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> TtyBar | LineBar | NoBar:
    """A progress bar: tqdm on a terminal, timed plain lines elsewhere, nothing when not `enabled`.

    `total` defaults to `len(iterable)`; `postfix` is the first status (what the start waits on).
    `file` defaults to sys.stderr (read at the call, so a redirected stderr is honoured); `tty`
    overrides the terminal check and `clock` the line mode's time source (tests). Every kind
    supports `update(n)`, `set_postfix(**kw)`, `set_postfix_str(s)`, `status(text)`, `write(text)`,
    `close()`, iteration (with `iterable`) and `with`.
    """
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if not enabled:
        return NoBar(iterable)
    file = sys.stderr if file is None else file
    if is_tty(file) if tty is None else tty:
        return TtyBar(
            iterable,
            total=total,
            desc=desc,
            initial=initial,
            unit=unit,
            leave=leave,
            file=file,
            postfix=postfix or None,
            dynamic_ncols=True,
        )
    return LineBar(
        total,
        desc,
        iterable=iterable,
        initial=initial,
        unit=unit,
        postfix=postfix,
        interval=interval,
        file=file,
        clock=clock,
    )


def note(text: str, enabled: bool = True, file: TextIO | None = None) -> None:
    """One message line on stderr, flushed at once (nothing when not `enabled`). On a terminal it
    goes through tqdm.write, above any bar being drawn."""
    if not enabled:
        return
    file = sys.stderr if file is None else file
    if is_tty(file):
        tqdm.write(text, file=file)
    else:
        print(text, file=file, flush=True)


class TtyBar(tqdm):
    """tqdm as it is (rate, ETA, postfix), plus `status`."""

    def status(self, text: str) -> None:
        """The phase being waited on, shown in the postfix right away."""
        self.set_postfix_str(text, refresh=True)


class NoBar:
    """`enabled=False`: the bar's interface, silent."""

    def __init__(self, iterable: Iterable | None = None):
        self.iterable, self.n = iterable, 0

    def __iter__(self) -> Iterator:
        for x in self.iterable:
            yield x
            self.n += 1

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def status(self, text: str) -> None:
        pass

    def write(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LineBar:
    """Not on a terminal: one plain line at the start, at most one every `interval` seconds while
    `update` is called, one at `close`, and one when `status` changes the phase."""

    def __init__(
        self,
        total: int | None,
        desc: str = "",
        *,
        iterable: Iterable | None = None,
        initial: int = 0,
        unit: str = "it",
        postfix: str = "",
        interval: float = INTERVAL_S,
        file: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total, self.desc, self.iterable, self.unit = total, desc, iterable, unit
        self.n = self.initial = int(initial)
        self.interval, self.file, self.clock = float(interval), file, clock
        self.postfix = str(postfix)
        self.start = self.last = clock()
        self.closed = False
        self._emitted: tuple | None = None  # (n, postfix) of the last line
        self._emit(self.start)

    # -- the tqdm interface ----------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        try:
            for x in self.iterable:
                yield x
                self.update(1)
        finally:
            self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self.last >= self.interval:
            self._emit(now)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={_short(v)}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)

    def status(self, text: str) -> None:
        """The phase being waited on: a line now when it is new (phases change rarely)."""
        if text != self.postfix:
            self.postfix = str(text)
            self._emit(self.clock())

    def write(self, text: str) -> None:
        print(text, file=self._file(), flush=True)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._emitted != (self.n, self.postfix):
            self._emit(self.clock())

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the line ----------------------------------------------------------------------------------
    def line(self, now: float) -> str:
        """`desc: n/total unit (pct%), rate, elapsed, ETA | postfix`."""
        elapsed = max(now - self.start, 0.0)
        done = self.n - self.initial
        rate = done / elapsed if elapsed > 0 and done > 0 else None
        count = f"{self.n}/{self.total} {self.unit}" if self.total else f"{self.n} {self.unit}"
        if self.total:
            count += f" ({100.0 * self.n / self.total:.0f}%)"
        if rate is None:
            speed = f"? {self.unit}/s"
        elif rate >= 1:
            speed = f"{rate:.3g} {self.unit}/s"
        else:
            speed = f"{1.0 / rate:.3g} s/{self.unit}"
        parts = [count, speed, f"elapsed {_clock(elapsed)}"]
        if self.total:
            left = max(self.total - self.n, 0)
            parts.append("ETA " + (_clock(left / rate) if rate else "?" if left else _clock(0.0)))
        text = (f"{self.desc}: " if self.desc else "") + ", ".join(parts)
        return text + (f" | {self.postfix}" if self.postfix else "")

    def _emit(self, now: float) -> None:
        print(self.line(now), file=self._file(), flush=True)
        self.last, self._emitted = now, (self.n, self.postfix)

    def _file(self) -> TextIO:
        return sys.stderr if self.file is None else self.file


def _short(v: Any) -> str:
    """A postfix value as tqdm shows it: floats to 3 significant digits."""
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _clock(seconds: float) -> str:
    """`m:ss`, or `h:mm:ss` from an hour on."""
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
