"""Device mesh, logical-axis rules and multi-host initialisation.

One `Mesh` with axes ('data', 'fsdp', 'tensor'). Parameters name their dimensions with logical
axes (`embed, heads, kv_heads, head_dim, mlp, vocab`) in their `nnx.Param` metadata; a rules table
maps each logical axis to a mesh axis (or None = replicated). The batch dimension of the data is
split over ('data', 'fsdp').

Divisibility: a mesh axis that does not divide a parameter dimension is *skipped* for that
dimension (the dimension is replicated over it) rather than failing, so one rules table serves every
model size and mesh (e.g. 2 kv heads on a tensor axis of 4). A mesh axis is also never used twice
in one spec (XLA forbids it); the later dimension is replicated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (str), several mesh axes (tuple) or None (replicated)
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "head_dim": None,
    "layers": None,  # the stacked-layer axis of scanned layers
    "batch": ("data", "fsdp"),
}

# Keys of a `config.mesh` section that are not mesh axes (see maybe_init_distributed;
# rollout_shards is read by the trainer).
_MESH_CONFIG_KEYS = (
    "distributed",
    "enabled",
    "coordinator_address",
    "num_processes",
    "process_id",
    "local_device_ids",
    "rollout_shards",
)
# The initialize() arguments, and the environment variables that fill them when the config leaves
# them unset ("" / 0 / -1): the names MaxText- and Tunix-style launch scripts export.
_DIST_ARGS = ("coordinator_address", "num_processes", "process_id", "local_device_ids")
DIST_ENV = {
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}

# Where different flax versions keep a Variable's logical axis names (newest first).
_AXES_METADATA_KEYS = ("out_sharding", "sharding_names", "sharding")


class ShardingError(ValueError):
    """A mesh or a logical-axis annotation is invalid; the message names the problem."""


def make_mesh(shape: Mapping[str, int] | Sequence[int], devices: Sequence[Any] | None = None) -> Mesh:
    """Mesh with axes ('data', 'fsdp', 'tensor').

    `shape` is a dict (missing axes = 1) or a (data, fsdp, tensor) tuple. One entry may be -1: it
    takes all the devices the others leave. The product must equal the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    if hasattr(shape, "to_dict"):  # ml_collections ConfigDict
        shape = shape.to_dict()
    if isinstance(shape, Mapping):
        # a whole `config.mesh` section may be passed: its non-axis keys are not shape entries
        shape = {k: v for k, v in shape.items() if k not in _MESH_CONFIG_KEYS}
        unknown = sorted(set(shape) - set(MESH_AXES))
        if unknown:
            raise ShardingError(f"make_mesh: unknown mesh axis {unknown}; axes are {MESH_AXES}")
        dims = [int(shape.get(a, 1)) for a in MESH_AXES]
    else:
        dims = [int(d) for d in shape]
        if len(dims) != len(MESH_AXES):
            raise ShardingError(f"make_mesh: shape {tuple(shape)} must have 3 entries {MESH_AXES}")
    if dims.count(-1) > 1 or any(d == 0 or d < -1 for d in dims):
        raise ShardingError(f"make_mesh: invalid shape {dict(zip(MESH_AXES, dims))}")
    if -1 in dims:
        known = int(np.prod([d for d in dims if d != -1]))
        if len(devices) % known:
            raise ShardingError(f"make_mesh: {len(devices)} devices not divisible by {known} for shape {dims}")
        dims[dims.index(-1)] = len(devices) // known
    if int(np.prod(dims)) != len(devices):
        raise ShardingError(
            f"make_mesh: shape {dict(zip(MESH_AXES, dims))} needs {int(np.prod(dims))} devices, got {len(devices)}"
        )
    grid = np.asarray(devices, dtype=object).reshape(dims)
    # Auto axes spelled out: the default of the constructors has moved between jax versions.
    axis_types = getattr(jax.sharding, "AxisType", None)
    if axis_types is not None:
        return Mesh(grid, MESH_AXES, axis_types=(axis_types.Auto,) * len(MESH_AXES))
    return Mesh(grid, MESH_AXES)


def _as_tuple(x: str | Sequence[str] | None) -> tuple[str, ...]:
    if x is None:
        return ()
    return (x,) if isinstance(x, str) else tuple(x)


def logical_to_spec(
    axes: Sequence[str | None] | None,
    rules: Mapping[str, Any] | None = None,
    mesh: Mesh | None = None,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """Logical axis names (one per dimension, None = replicated) -> PartitionSpec.

    With `mesh` and `shape`, a mesh axis whose size does not divide the dimension is skipped.
    An unknown logical name raises (a typo must not silently replicate a large matrix).
    """
    rules = DEFAULT_RULES if rules is None else rules
    if axes is None:
        return PartitionSpec()
    axes = tuple(axes)
    if shape is not None and len(shape) != len(axes):
        raise ShardingError(f"logical axes {axes} do not match the array rank {len(shape)} (shape {tuple(shape)})")
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(axes):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise ShardingError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        keep = []
        size = 1
        for mesh_axis in _as_tuple(rules[name]):
            if mesh is not None and mesh_axis not in mesh.shape:
                raise ShardingError(f"rule {name!r} -> {mesh_axis!r}: not an axis of the mesh {dict(mesh.shape)}")
            if mesh_axis in used:
                continue
            n = mesh.shape[mesh_axis] if mesh is not None else 1
            if shape is not None and shape[dim] % (size * n):
                continue  # does not divide: replicate over this mesh axis (see module docstring)
            keep.append(mesh_axis)
            size *= n
        used.update(keep)
        spec.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return PartitionSpec(*spec)


def variable_axes(var: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names stored in a Variable's metadata (None if it has none)."""
    meta = var.get_metadata()
    for key in _AXES_METADATA_KEYS:
        if meta.get(key):
            return tuple(meta[key])
    return None


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(params_state: Any, mesh: Mesh, rules: Mapping[str, Any] | None = None) -> Any:
    """Pytree of NamedSharding with the structure of `params_state`.

    Works on any tree holding `nnx.Variable`s (params, or an optax state whose moments mirror
    them, since optax keeps the Variable wrappers and their metadata); plain arrays and Variables
    without axis names are replicated. Arrays may be concrete or `jax.ShapeDtypeStruct`.
    """

    def one(x):
        if _is_var(x):
            value = x.get_value() if hasattr(x, "get_value") else x.value
            spec = logical_to_spec(variable_axes(x), rules, mesh, np.shape(value))
            return x.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, params_state, is_leaf=_is_var)


def shard_params(params: Any, mesh: Mesh, rules: Mapping[str, Any] | None = None) -> Any:
    """Place `params` on the mesh according to their logical axes."""
    return jax.device_put(params, param_shardings(params, mesh, rules))


def data_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over ('data', 'fsdp'); other dimensions replicated."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def host_local_to_global(tree: Any, mesh: Mesh) -> Any:
    """Each host's rows [S_local, ...] -> global arrays [S_local * hosts, ...] split like data_sharding.

    Multi-host: every process passes its own slice of the batch (its environments' rows). On
    one process this is a device_put with `data_sharding(mesh)`.
    """
    sharding = data_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)


def distributed_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The `jax.distributed.initialize` keyword arguments a `config.mesh` section asks for.

    Unset values ("" / None for the address, 0 or less for the process count, negative for the
    process id, "" / None for local_device_ids) fall back to the environment variables in
    DIST_ENV; what is still unset is left out, for jax's own auto-detection (Cloud TPU, SLURM,
    Open MPI). local_device_ids may be an int, a list or a comma-separated string.
    """
    import os

    out: dict[str, Any] = {}
    addr = cfg.get("coordinator_address") or os.environ.get(DIST_ENV["coordinator_address"]) or None
    if addr:
        out["coordinator_address"] = str(addr)
    for key in ("num_processes", "process_id"):
        val = cfg.get(key)
        if val is None or int(val) < (1 if key == "num_processes" else 0):
            env = os.environ.get(DIST_ENV[key], "").strip()
            try:
                val = int(env) if env else None
            except ValueError:
                raise ShardingError(f"environment variable {DIST_ENV[key]}={env!r} is not an integer") from None
        if val is not None:
            out[key] = int(val)
    ids = cfg.get("local_device_ids")
    if ids not in (None, "", ()):
        if isinstance(ids, str):
            ids = [int(i) for i in ids.split(",") if i.strip()]
        out["local_device_ids"] = ids
    n, i = out.get("num_processes"), out.get("process_id")
    if n is not None and i is not None and not 0 <= i < n:
        raise ShardingError(f"distributed: process_id={i} is not in [0, num_processes={n})")
    return out


def _use_cpu_collectives() -> None:
    """Cross-process collectives on the CPU backend need an implementation chosen before the
    backend starts: gloo (TCP, no extra install). It is the default on jax 0.10; older versions
    default to none (collectives across processes then fail at run time), and a version that
    drops the option has its own default, so a missing option is not an error."""
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, KeyError, ValueError):  # the option is gone or renamed
        pass


def maybe_init_distributed(cfg: Mapping[str, Any] | None) -> bool:
    """Call `jax.distributed.initialize` when enabled; return whether it is initialised.

    cfg: a `config.mesh` section or a dict with `enabled` (or `distributed`) and optionally
    coordinator_address, num_processes, process_id, local_device_ids (see distributed_options
    for unset values and environment fallbacks). Call before any other jax call that touches
    devices.
    """
    if cfg is None:
        return False
    cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)  # ml_collections or dict
    unknown = sorted(set(cfg) - set(_MESH_CONFIG_KEYS) - set(MESH_AXES))
    if unknown:
        raise ShardingError(
            f"distributed config: unknown key(s) {unknown}; allowed: {list(_MESH_CONFIG_KEYS + MESH_AXES)}"
        )
    if not (cfg.get("enabled", False) or cfg.get("distributed", False)):
        return False
    if jax.distributed.is_initialized():
        return True
    kwargs = distributed_options(cfg)
    _use_cpu_collectives()
    jax.distributed.initialize(**kwargs)
    return True


# --------------------------------------------------------------------------------------------
# several processes: host copies <-> global arrays


def global_from_host(tree: Any, sharding: NamedSharding) -> Any:
    """Global arrays from a host value that EVERY process holds in full (e.g. a mini-batch cut
    from a batch all processes gathered): each process supplies the shards of its own devices.
    Unlike `host_local_to_global` nothing is concatenated, so the global array equals the host
    value on any process layout. One process: a device_put."""
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree.map(one, tree)


def fetch_global(tree: Any) -> Any:
    """Host numpy of arrays that may have shards on other processes (then a collective: every
    process must call it at the same point). Fully addressable or replicated arrays are read
    locally."""

    def local(x):
        return not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated

    if all(local(x) for x in jax.tree.leaves(tree)):
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's picklable `obj`, in process order (one list, the same on every process).

    Two collectives: the byte sizes, then the bytes padded to the largest. Meant for rollout
    results (numpy arrays, texts); see docs/TPU.md for what this costs on large batches.
    """
    import pickle

    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    buf = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([buf.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: buf.size] = buf
    every = np.asarray(multihost_utils.process_allgather(padded))  # [processes, max size]
    return [pickle.loads(every[i, : int(n)].tobytes()) for i, n in enumerate(sizes)]


def local_mesh(tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh over this process's own devices (fsdp takes what `tensor` leaves): where a process
    samples its own rollouts without waiting on other hosts."""
    return make_mesh(
        {"data": 1, "fsdp": -1, "tensor": int(tensor)}, devices=jax.local_devices() if devices is None else devices
    )
