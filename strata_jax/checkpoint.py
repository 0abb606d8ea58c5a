"""Exact, resumable checkpoints: an orbax CheckpointManager holding the train state and run progress.

Each step directory holds two items:
  state   the train state (any pytree of arrays: params, optimizer state, step, rng, ...), stored as
          a nested dict keyed by the pytree path, so the on-disk layout does not depend on how
          flax / optax classes flatten, and a mismatch can be named by path;
  extra   the run's progress as JSON (iteration, data position, rollout rng, metric history).

Restoring takes an abstract target (shapes, dtypes and shardings) and so lands on any mesh: a run
saved on 8 devices resumes on 1, and the reverse. Before orbax reads any array, the checkpoint's
metadata tree is compared with the target; the first difference raises CheckpointMismatchError
naming the parameter path and both shapes.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Sharding

_STATE, _EXTRA = "state", "extra"


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the target model (different shapes, or missing/extra keys)."""


def _key_str(k) -> str:
    for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _flat(tree) -> tuple[list[tuple[tuple[str, ...], Any]], Any]:
    """[(path as strings, leaf)] in pytree order, and the treedef."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(_key_str(k) for k in path), leaf) for path, leaf in pairs], treedef


def _nest(pairs) -> dict:
    out: dict = {}
    for path, leaf in pairs:
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf
    return out


def _lookup(tree: dict, path: tuple[str, ...]):
    for k in path:
        tree = tree[k]
    return tree


def _show(path: tuple[str, ...]) -> str:
    return "/".join(path)


def _check_leaf(path, leaf):
    if jax.dtypes.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key):
        raise TypeError(f"checkpoint: leaf {_show(path)} is a typed PRNG key; store jax.random.key_data(key)")


def _compare(target_pairs, saved_pairs) -> None:
    """Raise CheckpointMismatchError at the first path whose presence or shape differs."""
    saved = {p: tuple(getattr(m, "shape", ())) for p, m in saved_pairs}
    for path, leaf in target_pairs:
        if path not in saved:
            raise CheckpointMismatchError(
                f"checkpoint has no parameter {_show(path)} (model shape {tuple(np.shape(leaf))})"
            )
        if saved[path] != tuple(np.shape(leaf)):
            raise CheckpointMismatchError(
                f"parameter {_show(path)}: checkpoint shape {saved[path]} != model shape {tuple(np.shape(leaf))}"
            )
    extra = sorted(set(saved) - {p for p, _ in target_pairs})
    if extra:
        raise CheckpointMismatchError(
            f"checkpoint has parameter {_show(extra[0])} (shape {saved[extra[0]]}) that the model lacks"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
        )


class Checkpointer:
    """Save every `save_every` steps, keep the latest `keep`, optionally writing in the background.

    An async save copies the arrays to host memory before returning, so the caller may donate or
    overwrite the train state right after `save`.
    """

    def __init__(
        self, directory: str | os.PathLike, save_every: int = 1, keep: int | None = 3, async_save: bool = True
    ):
        if save_every < 1:
            raise ValueError(f"Checkpointer: save_every must be >= 1, got {save_every}")
        if keep is not None and keep < 1:
            raise ValueError(f"Checkpointer: keep must be >= 1 or None, got {keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_every, max_to_keep=keep, enable_async_checkpointing=async_save, create=True
        )
        # Handlers named up front: a fresh process can then read metadata before any save.
        handlers = {_STATE: ocp.StandardCheckpointHandler(), _EXTRA: ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def save(self, step: int, train_state: Any, extra: dict | None = None, force: bool = False) -> bool:
        """Save if `step` is due (or `force`); returns whether a save started."""
        pairs, _ = _flat(train_state)
        for path, leaf in pairs:
            _check_leaf(path, leaf)
        extra = {} if extra is None else extra
        try:
            json.dumps(extra)
        except TypeError as e:
            raise TypeError(f"Checkpointer.save: `extra` must be JSON-serialisable: {e}") from None
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(_nest(pairs)), _EXTRA: ocp.args.JsonSave(extra)})
        return bool(self._manager.save(int(step), args=args, force=force))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore_latest(self, target: Any, shardings: Any = None) -> tuple[Any, dict] | None:
        """(train_state, extra) from the latest checkpoint, or None when there is none."""
        step = self.latest_step()
        return None if step is None else self.restore(step, target, shardings)

    def restore(self, step: int, target: Any, shardings: Any = None) -> tuple[Any, dict]:
        """Restore `step` into the structure of `target`.

        target: pytree of arrays or jax.ShapeDtypeStruct (e.g. `jax.eval_shape` of the init).
        shardings: pytree of jax.sharding.Sharding matching `target`; None uses the shardings the
        target leaves carry (a leaf without one is placed on the default device).
        """
        pairs, treedef = _flat(target)
        if shardings is None:
            sh = [getattr(leaf, "sharding", None) for _, leaf in pairs]
        else:
            sh = treedef.flatten_up_to(shardings) if not isinstance(shardings, Sharding) else [shardings] * len(pairs)
        meta = self._manager.item_metadata(step)[_STATE]
        saved_pairs, _ = _flat(getattr(meta, "tree", meta))
        _compare(pairs, saved_pairs)
        abstract = [
            (p, jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=s)) for (p, leaf), s in zip(pairs, sh)
        ]
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(_nest(abstract)), _EXTRA: ocp.args.JsonRestore()})
        out = self._manager.restore(step, args=args)
        restored = out[_STATE]
        leaves = [_lookup(restored, p) for p, _ in pairs]
        return jax.tree_util.tree_unflatten(treedef, leaves), dict(out[_EXTRA] or {})

    def wait(self) -> None:
        """Block until a background save has finished writing."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
