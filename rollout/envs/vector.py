"""Batched environments: `EnvPool` (worker processes) and `SerialEnvPool` (in-process), one API.

    pool = EnvPool([functools.partial(make_env, "alfworld", data_dir=d)] * 16, num_workers=4)
    outs = pool.reset(env_indices=[0, 1, 2], seeds=[7, 7, 7])        # [(obs, info) | EnvFailure]
    outs = pool.step(env_indices=[0, 2], actions=["look", "go to desk 1"])
                                                  # [(obs, r, term, trunc, info) | EnvFailure]

Results come back aligned with `env_indices`. A failed env gives an `EnvFailure` record
(`crashed=True`, `kind`, `error`) in its slot instead of raising, so the rollout loop can mask that
trajectory out and count it; every other env's result is unaffected.

Failure kinds:
    exception  the env raised (the worker survives; that episode should be dropped)
    crash      the worker process died (exit code in the error)
    timeout    no answer within `timeout_s`; the worker is killed
    restarted  the env lost its episode because its worker was restarted and replay failed;
               call reset on it
A killed or dead worker is restarted with fresh envs. The other envs of that worker get their
episode back by replaying (reset seed + the actions since), which is exact because environments
are deterministic given the seed; an env is never silently left in a different state.

Fault injection (tests only, `fault_injection=True`): the actions "__crash__" (the worker exits),
"__hang__" (the worker sleeps forever) and "__raise__" (the env raises) fail on purpose.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from rollout.envs.base import EnvError

FAULTS = ("__crash__", "__hang__", "__raise__")


@dataclass
class EnvFailure:
    """An env's result slot when it failed; `crashed` is always True (the loop's test)."""

    env_index: int
    kind: str  # exception | crash | timeout | restarted
    error: str
    crashed: bool = True


def _check_batch(n_envs: int, env_indices: Sequence[int], args: Sequence[Any], what: str) -> list[int]:
    idx = [int(i) for i in env_indices]
    if len(idx) != len(args):
        raise ValueError(f"{len(idx)} env_indices but {len(args)} {what}")
    if len(set(idx)) != len(idx):
        raise ValueError(f"duplicate env_indices in one call: {idx}")
    bad = [i for i in idx if not 0 <= i < n_envs]
    if bad:
        raise ValueError(f"env_indices {bad} out of range [0, {n_envs})")
    return idx


def _fault(action: Any) -> None:
    """Injected failures (only called when the pool was built with fault_injection=True)."""
    if action == "__crash__":
        os._exit(17)
    if action == "__hang__":
        while True:
            time.sleep(3600)
    if action == "__raise__":
        raise RuntimeError("injected env failure")


# ----------------------------------------------------------------------------- in-process pool


class SerialEnvPool:
    """The same API as EnvPool, in this process (tests, tiny CPU runs). A "crash" rebuilds the env.

    Hangs cannot be interrupted in-process: with fault_injection, "__hang__" is reported as a
    timeout (and "__crash__" as a crash) without running anything.
    """

    def __init__(self, env_fns: Sequence[Callable[[], Any]], fault_injection: bool = False):
        if not env_fns:
            raise ValueError("env_fns is empty")
        self.env_fns = list(env_fns)
        self.envs = [fn() for fn in self.env_fns]
        self.fault_injection = fault_injection
        self.stats = {"exception": 0, "crash": 0, "timeout": 0, "restarted": 0, "restarts": 0}

    @property
    def num_envs(self) -> int:
        return len(self.envs)

    def reset(self, env_indices: Sequence[int], seeds: Sequence[int]) -> list:
        idx = _check_batch(self.num_envs, env_indices, seeds, "seeds")
        return [self._call(i, "reset", s) for i, s in zip(idx, seeds)]

    def step(self, env_indices: Sequence[int], actions: Sequence[str]) -> list:
        idx = _check_batch(self.num_envs, env_indices, actions, "actions")
        return [self._call(i, "step", a) for i, a in zip(idx, actions)]

    def _call(self, i: int, method: str, arg: Any):
        if self.fault_injection and method == "step" and arg in ("__crash__", "__hang__"):
            kind = "crash" if arg == "__crash__" else "timeout"
            self.envs[i] = self.env_fns[i]()  # as a restarted worker would have it
            self.stats[kind] += 1
            self.stats["restarts"] += 1
            return EnvFailure(i, kind, f"injected {kind}")
        try:
            if self.fault_injection and method == "step":
                _fault(arg)
            if method == "reset":
                return self.envs[i].reset(seed=int(arg))
            return self.envs[i].step(arg)
        except Exception as e:  # noqa: BLE001 - any env failure is that env's failure record
            self.stats["exception"] += 1
            return EnvFailure(i, "exception", f"{type(e).__name__}: {e}")

    def close(self) -> None:
        for env in self.envs:
            env.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------- worker processes


def _worker(conn, env_fns: dict, fault_injection: bool) -> None:
    """Worker main loop: build its envs, then answer (cmd, [(env_index, arg), ...]) messages.

    Each env's answer is sent as soon as it is ready: (env_index, ok, result_or_error), so a later
    hang in the same batch does not lose earlier results.
    """
    try:
        envs = {i: fn() for i, fn in env_fns.items()}
    except Exception:  # noqa: BLE001
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            cmd, batch = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if cmd == "close":
            for env in envs.values():
                env.close()
            return
        for i, arg in batch:
            try:
                if cmd == "reset":
                    out = envs[i].reset(seed=int(arg))
                elif cmd == "step":
                    if fault_injection:
                        _fault(arg)
                    out = envs[i].step(arg)
                else:  # replay: (seed, actions) -> the env back in its episode's state
                    seed, actions = arg
                    envs[i].reset(seed=int(seed))
                    for a in actions:
                        envs[i].step(a)
                    out = None
                conn.send((i, True, out))
            except Exception as e:  # noqa: BLE001
                conn.send((i, False, f"{type(e).__name__}: {e}"))


class EnvPool:
    """Envs spread over worker processes (env i lives on worker i % num_workers); see module doc."""

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any]],
        num_workers: int | None = None,
        timeout_s: float = 60.0,
        start_timeout_s: float = 300.0,
        fault_injection: bool = False,
        start_method: str = "spawn",
    ):
        if not env_fns:
            raise ValueError("env_fns is empty")
        if timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError("timeout_s and start_timeout_s must be > 0")
        n = len(env_fns)
        num_workers = min(n, num_workers or os.cpu_count() or 1)
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.env_fns, self.num_workers = list(env_fns), num_workers
        self.timeout_s, self.start_timeout_s = float(timeout_s), float(start_timeout_s)
        self.fault_injection = fault_injection
        # spawn by default: forking a process that runs JAX threads can deadlock the child.
        self.ctx = mp.get_context(start_method)
        self.owner = [i % num_workers for i in range(n)]
        self.history: list[tuple[int, list[str]] | None] = [None] * n  # (seed, actions) per env
        self.stats = {"exception": 0, "crash": 0, "timeout": 0, "restarted": 0, "restarts": 0}
        self.lost: list[str | None] = [None] * n  # why an env's episode is gone (reset clears)
        self.down: list[str | None] = [None] * num_workers  # why a worker failed to restart
        self.procs: list[Any] = [None] * num_workers
        self.conns: list[Any] = [None] * num_workers
        self.closed = False
        for w in range(num_workers):
            self._launch(w)
        for w in range(num_workers):
            error = self._await_ready(w)
            if error:
                self.close()
                raise EnvError(f"env worker {w} could not build its envs:\n{error}")

    @property
    def num_envs(self) -> int:
        return len(self.env_fns)

    # -- workers -----------------------------------------------------------------------------

    def _launch(self, w: int) -> None:
        parent, child = self.ctx.Pipe()
        fns = {i: self.env_fns[i] for i in range(self.num_envs) if self.owner[i] == w}
        proc = self.ctx.Process(
            target=_worker, args=(child, fns, self.fault_injection), daemon=True, name=f"env-worker-{w}"
        )
        proc.start()
        child.close()
        self.procs[w], self.conns[w] = proc, parent

    def _await_ready(self, w: int) -> str | None:
        """None when worker w is up; else why not."""
        conn = self.conns[w]
        try:
            if not conn.poll(self.start_timeout_s):
                return f"no answer within start_timeout_s={self.start_timeout_s}"
            tag, payload = conn.recv()
        except (EOFError, OSError):
            self.procs[w].join(1)
            return f"worker died while starting (exit code {self.procs[w].exitcode})"
        return payload if tag == "init_error" else None

    def _kill(self, w: int) -> None:
        proc, conn = self.procs[w], self.conns[w]
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        conn.close()

    def _ensure_up(self, w: int) -> str | None:
        """Relaunch worker w if an earlier restart left it down; None when it is up."""
        if self.down[w] is None:
            return None
        self._kill(w)
        self._launch(w)
        self.down[w] = self._await_ready(w)
        return self.down[w]

    def _restart(self, w: int, failed: int) -> dict[int, EnvFailure]:
        """Replace worker w after env `failed` broke it; replay the other envs' episodes.

        Returns failure records for envs whose episode could not be brought back (they are also
        marked lost, so a later step on them fails until they are reset)."""
        self._kill(w)
        self.stats["restarts"] += 1
        self._launch(w)
        self.history[failed] = None
        self.lost[failed] = "its worker was restarted after it failed"
        mine = [i for i in range(self.num_envs) if self.owner[i] == w and i != failed]
        self.down[w] = self._await_ready(w)
        if self.down[w]:
            why = f"worker {w} restart failed: {self.down[w]}"
            for i in mine:
                self.history[i], self.lost[i] = None, why
            return {i: EnvFailure(i, "restarted", why) for i in mine}
        todo = [(i, self.history[i]) for i in mine if self.history[i] is not None]
        results, broke = self._exchange(w, "replay", todo) if todo else ({}, None)
        out = {}
        for i, r in results.items():
            if isinstance(r, EnvFailure) and i != broke:
                why = f"episode lost in worker {w} restart: {r.error}"
                self.history[i], self.lost[i] = None, why
                out[i] = EnvFailure(i, "restarted", why)
        if broke is not None:  # replaying `broke` broke the new worker: drop it and start again
            why = f"its replay broke worker {w}: {results[broke].error}"
            out.update(self._restart(w, broke))
            out[broke] = EnvFailure(broke, "restarted", why)
            self.lost[broke] = why
        return out

    def _exchange(self, w: int, cmd: str, batch: list) -> tuple[dict[int, Any], int | None]:
        """One batch to worker w; answers until done. Returns (results, env that broke it or None)."""
        self._send(w, cmd, batch)
        results: dict[int, Any] = {}
        pending = [i for i, _ in batch]
        while pending:
            failure = self._receive(w, pending, results)
            if failure is not None:
                results[failure.env_index] = failure
                return results, failure.env_index
        return results, None

    def _send(self, w: int, cmd: str, batch: list) -> None:
        try:
            self.conns[w].send((cmd, batch))
        except (BrokenPipeError, OSError):
            pass  # a dead worker is reported by _receive

    def _receive(self, w: int, pending: list[int], results: dict, timeout: float | None = None):
        """Take one answer from worker w into `results`; an EnvFailure if it died or hung."""
        conn = self.conns[w]
        try:
            if not conn.poll(self.timeout_s if timeout is None else timeout):
                return EnvFailure(pending[0], "timeout", f"no answer within {self.timeout_s} s")
            i, ok, payload = conn.recv()
        except (EOFError, OSError):
            self.procs[w].join(1)
            return EnvFailure(pending[0], "crash", f"worker {w} died (exit code {self.procs[w].exitcode})")
        results[i] = payload if ok else EnvFailure(i, "exception", payload)
        pending.remove(i)
        return None

    # -- batched calls -----------------------------------------------------------------------

    def reset(self, env_indices: Sequence[int], seeds: Sequence[int]) -> list:
        idx = _check_batch(self.num_envs, env_indices, seeds, "seeds")
        out = self._run("reset", dict(zip(idx, (int(s) for s in seeds))))
        return [out[i] for i in idx]

    def step(self, env_indices: Sequence[int], actions: Sequence[str]) -> list:
        idx = _check_batch(self.num_envs, env_indices, actions, "actions")
        out = self._run("step", dict(zip(idx, actions)))
        return [out[i] for i in idx]

    def _record(self, cmd: str, i: int, arg: Any, result: Any) -> None:
        """Keep each env's episode (seed, actions) so a restarted worker can replay it."""
        if isinstance(result, EnvFailure):
            self.history[i] = None
            self.lost[i] = self.lost[i] or f"its last {cmd} failed"
        elif cmd == "reset":
            self.history[i], self.lost[i] = (arg, []), None
        elif self.history[i] is not None:
            self.history[i][1].append(arg)

    def _run(self, cmd: str, calls: dict[int, Any]) -> dict[int, Any]:
        if self.closed:
            raise EnvError("the pool is closed")
        results: dict[int, Any] = {}
        by_worker: dict[int, list] = {}
        for i, arg in calls.items():
            w = self.owner[i]
            if cmd == "step" and self.lost[i]:  # its episode is gone: say so, run nothing
                results[i] = EnvFailure(i, "restarted", f"episode lost ({self.lost[i]}); reset it")
            elif self._ensure_up(w):
                results[i] = EnvFailure(i, "restarted", f"worker {w} is down: {self.down[w]}")
            else:
                by_worker.setdefault(w, []).append((i, arg))
        for w, batch in by_worker.items():  # send everything first: the workers run in parallel
            self._send(w, cmd, batch)
        pending = {w: [i for i, _ in b] for w, b in by_worker.items()}
        deadline = {w: time.monotonic() + self.timeout_s for w in pending}
        broken: dict[int, int] = {}  # worker -> the env that crashed or hung it
        while pending:
            ready = wait([self.conns[w] for w in pending], timeout=max(0.0, min(deadline.values()) - time.monotonic()))
            for w in list(pending):
                if self.conns[w] not in ready and deadline[w] > time.monotonic():
                    continue
                failure = self._receive(w, pending[w], results, timeout=0)
                if failure is not None:
                    results[failure.env_index] = failure
                    broken[w] = failure.env_index
                    pending[w].remove(failure.env_index)
                    del pending[w]
                    continue
                deadline[w] = time.monotonic() + self.timeout_s  # progress resets the clock
                if not pending[w]:
                    del pending[w]
        for i, r in results.items():
            if i in calls and not (isinstance(r, EnvFailure) and r.kind == "restarted"):
                self._record(cmd, i, calls[i], r)
        for w, failed in broken.items():
            results.update(self._recover(cmd, w, failed, by_worker[w], calls, results))
        for r in results.values():
            if isinstance(r, EnvFailure):
                self.stats[r.kind] += 1
        return results

    def _recover(self, cmd: str, w: int, failed: int, batch: list, calls: dict, results: dict):
        """Restart worker w, then run the calls of this batch that were queued behind `failed`."""
        out = self._restart(w, failed)
        queued = [(i, a) for i, a in batch if i not in results and i not in out]
        if not queued:
            return out
        rerun, broke = self._exchange(w, cmd, queued)
        for i, _ in queued:
            r = rerun.get(i)
            if r is None:
                r = EnvFailure(i, "restarted", f"worker {w} failed again before this env ran")
            out[i] = r
            self._record(cmd, i, calls[i], r)
        if broke is not None:  # a second failure in the same call: restart, no more reruns
            for i, f in self._restart(w, broke).items():
                out.setdefault(i, f)
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            if conn is None:
                continue
            try:
                conn.send(("close", []))
            except (BrokenPipeError, OSError):
                pass
        for w, proc in enumerate(self.procs):
            if proc is None:
                continue
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            self.conns[w].close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
