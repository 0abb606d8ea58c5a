"""Grid-last kernels: one call computes every point of a `jax.vmap` hyper-parameter grid.

    kernel = grid_last(lambda per_point, shared: ..., busy)   # leaves of per_point: [..., G]
    kernel(per_point, shared)                            # one point: no grid axis anywhere
    jax.vmap(kernel, in_axes=(0, None))(stacked, shared) # the grid: ONE kernel call, G = grid size

Why: the grouping of steps (anchor states, CAR keys) depends on the batch only, so under a vmap
over AdvantageParams only values vary per point. jax.vmap would put the grid axis first ([G, T])
and batch each group sum as a scatter of one strided column per point, which XLA:CPU runs ~30x
slower than the same scatter of contiguous [T, G] rows. A kernel is written once with the grid
axis LAST (one point is G = 1); `custom_vmap` routes a vmap over `per_point` to one call with the
whole grid there, and moves the grid axis to the front of the outputs (one transpose each).

A vmap over `shared` as well (e.g. a population vmapped over batches AND params) has no shared
grouping to exploit: it falls back to a plain vmap of the one-point form (same results).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap


def grid_last(kernel: Callable[[Any, Any], Any], busy: Callable[[Any], jax.Array]) -> Callable[[Any, Any], Any]:
    """Wrap kernel(per_point, shared) -> pytree of [..., G] arrays (see the module docstring).

    Every per_point leaf carries the grid axis last ([..., G]; a scalar parameter is a [G]
    vector); kernel must broadcast a size-1 grid axis (a leaf that is not vmapped gets G = 1).
    busy(shared) -> scalar bool: False only when every output is 0 (nothing to group), so the
    grid call may skip the kernel. That `lax.cond` is also what keeps the grid fast: XLA:CPU would
    otherwise fuse the grid-first transpose of the outputs into the kernel's last gathers and
    redo each gather per element in transposed order (4-7x slower than gathering into a buffer
    and transposing it); a conditional's result is its own buffer, and XLA removes
    `optimization_barrier`s before fusion.
    """

    def one_point(per_point, shared):
        out = kernel(jax.tree.map(lambda x: jnp.asarray(x)[..., None], per_point), shared)
        return jax.tree.map(lambda y: y[..., 0], out)

    fn = custom_vmap(one_point)

    @fn.def_vmap
    def _rule(axis_size, in_batched, per_point, shared):
        point_b, shared_b = in_batched
        if any(jax.tree.leaves(shared_b)):  # the grouping varies too: nothing to share
            # in_axes per leaf: the flags' own pytree would rebuild the args' classes from bools.
            leaves, treedef = jax.tree.flatten((per_point, shared))
            axes = [0 if b else None for b in jax.tree.leaves(in_batched)]
            out = jax.vmap(lambda *xs: one_point(*jax.tree.unflatten(treedef, xs)), in_axes=axes)(*leaves)
            return out, jax.tree.map(lambda _: True, out)
        per_point = jax.tree.map(
            lambda x, b: jnp.moveaxis(x, 0, -1) if b else jnp.asarray(x)[..., None], per_point, point_b
        )
        shapes = jax.eval_shape(kernel, per_point, shared)
        out = jax.lax.cond(
            busy(shared),
            kernel,
            lambda *_: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes),
            per_point,
            shared,
        )
        out = jax.tree.map(lambda y: jnp.moveaxis(jnp.broadcast_to(y, y.shape[:-1] + (axis_size,)), -1, 0), out)
        return out, jax.tree.map(lambda _: True, out)

    return fn
