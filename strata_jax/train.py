"""The policy update: TrainState, AdamW, and one jitted, sharded, donated train step.

One `train_step` call is one optimiser step on one mini-batch (a TokenBatch [S, L]); the caller
runs an epoch over the iteration's rows in mini-batches (`minibatches`). Inside the step the
mini-batch is split into `micro_batches` along S and the gradient is accumulated with `lax.scan`:
loss sums, gradient sums and counts are added up and divided once, so any micro-batch count gives
the update of the full mini-batch.

Step semantics:
  - `step` counts train_step calls; the optimiser's own counter (which drives the lr schedule)
    advances only on applied updates.
  - A non-finite loss or gradient leaves params and optimiser state unchanged and adds 1 to
    `skipped`. A mini-batch without any loss token is not applied either (AdamW would still decay
    the weights on a zero gradient) and is not counted as skipped; `tokens` reports 0.
  - `rng` is a raw uint32 key (checkpointable), split once per step for future stochastic layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from strata_jax.batch import TokenBatch
from strata_jax.loss import LossConfig, combine_metrics, empty_metrics, finalize_metrics, policy_loss
from strata_jax.models.heads import token_logprobs
from strata_jax.models.qwen2 import positions_from_mask
from strata_jax.names import SCHEDULES
from strata_jax.packing import SharedBatch
from strata_jax.sharding import data_sharding, param_shardings, replicated, shard_params
from strata_jax.tree import TreeRows


@struct.dataclass
class TrainState:
    params: Any  # nnx.State of nnx.Param: what trains (with LoRA, the adapters alone)
    opt_state: Any  # optax state (its moments keep the Param wrappers, hence their logical axes)
    step: jax.Array  # i32 []: train_step calls so far
    rng: jax.Array  # u32 [2]: raw key data
    skipped: jax.Array  # i32 []: updates skipped for a non-finite loss or gradient
    # With LoRA (strata_jax/lora.py): the base model's params, passed through every step unchanged
    # (no gradient, no optimiser state, not checkpointed); None without LoRA.
    frozen: Any = None

    @property
    def model_params(self):
        """The params the model's graphdef merges with: the frozen base and the adapters joined."""
        if self.frozen is None:
            return self.params
        from strata_jax.lora import join

        return join(self.frozen, self.params)


# ----------------------------------------------------------------------------------------------
# Optimiser


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0  # global-norm clip, before AdamW
    schedule: str = "constant"  # "constant" (after an optional linear warmup) | "warmup_cosine"
    warmup_steps: int = 0
    end_lr_ratio: float = 0.0  # warmup_cosine: final lr = lr * end_lr_ratio
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8


def optimizer_config(cfg: OptimizerConfig | Mapping | None) -> OptimizerConfig:
    """OptimizerConfig from itself, None (defaults) or a mapping such as `config.train`.

    Keys of a mapping that are not optimiser fields (the loss and batching keys of the same
    section) are ignored; the config module validates key names.
    """
    if cfg is None:
        return OptimizerConfig()
    if isinstance(cfg, OptimizerConfig):
        return cfg
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    names = {f.name for f in dataclasses.fields(OptimizerConfig)}
    return OptimizerConfig(**{k: v for k, v in d.items() if k in names})


def make_schedule(cfg: OptimizerConfig, total_steps: int | None = None) -> optax.Schedule:
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"optimizer schedule {cfg.schedule!r} is unknown; choose from {SCHEDULES}")
    if cfg.schedule == "warmup_cosine":
        if not total_steps or total_steps <= cfg.warmup_steps:
            raise ValueError(
                f"schedule 'warmup_cosine' needs total_steps > warmup_steps={cfg.warmup_steps}, got {total_steps}"
            )
        return optax.warmup_cosine_decay_schedule(
            0.0, cfg.lr, cfg.warmup_steps, total_steps, end_value=cfg.lr * cfg.end_lr_ratio
        )
    if cfg.warmup_steps > 0:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), optax.constant_schedule(cfg.lr)], [cfg.warmup_steps]
        )
    return optax.constant_schedule(cfg.lr)


def make_optimizer(
    cfg: OptimizerConfig | Mapping | None = None, total_steps: int | None = None
) -> optax.GradientTransformation:
    """Global-norm clip, then AdamW (decoupled weight decay on every parameter) on a schedule."""
    cfg = optimizer_config(cfg)
    if cfg.grad_clip <= 0:
        raise ValueError(f"grad_clip must be > 0, got {cfg.grad_clip}")
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(make_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay),
    )


def loss_config(train_cfg: Mapping) -> LossConfig:
    """LossConfig from a `config.train` section; the entropy bonus is on iff entropy_coef != 0, and
    the reference log-probs are read iff kl_coef != 0 (`uses_reference`)."""
    d = train_cfg.to_dict() if hasattr(train_cfg, "to_dict") else dict(train_cfg)
    keys = ("eps_low", "eps_high", "dual_clip", "kl_coef", "entropy_coef", "aggregation")
    kw = {k: d[k] for k in keys if k in d}
    return LossConfig(**kw, entropy_bonus=bool(kw.get("entropy_coef", 0.0)), reference=uses_reference(d))


def uses_reference(train_cfg: Mapping) -> bool:
    """Whether a run with this `config.train` needs the reference policy: only its KL term reads it.
    With kl_coef = 0 the run keeps no reference params and skips their scoring pass."""
    return float(train_cfg.get("kl_coef", LossConfig.kl_coef)) != 0.0


# ----------------------------------------------------------------------------------------------
# State and its shardings


def _raw_key(rng) -> jax.Array:
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    if jax.dtypes.issubdtype(jnp.asarray(rng).dtype if not hasattr(rng, "dtype") else rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    rng = jnp.asarray(rng, jnp.uint32)
    if rng.shape != (2,):
        raise ValueError(f"rng: expected an int seed, a key, or uint32[2] key data, got shape {rng.shape}")
    return rng


def train_state_shardings(state: TrainState, mesh: Mesh, rules: Mapping | None = None) -> TrainState:
    """NamedShardings for every leaf of a (concrete or abstract) TrainState."""
    repl = replicated(mesh)
    return TrainState(
        params=param_shardings(state.params, mesh, rules),
        opt_state=param_shardings(state.opt_state, mesh, rules),
        step=repl,
        rng=repl,
        skipped=repl,
        frozen=None if state.frozen is None else param_shardings(state.frozen, mesh, rules),
    )


def abstract_train_state(
    params: Any, optimizer: optax.GradientTransformation, mesh: Mesh, rules: Mapping | None = None
) -> TrainState:
    """ShapeDtypeStruct TrainState with shardings: a restore target that allocates nothing (and
    no frozen base: checkpoints hold what trains, see TrainState.frozen).

    `params` may be concrete or abstract (e.g. `nnx.split(nnx.eval_shape(lambda: Decoder(...)))`).
    """

    def build(p):
        return TrainState(
            params=p,
            opt_state=optimizer.init(p),
            step=jnp.zeros((), jnp.int32),
            rng=jnp.zeros((2,), jnp.uint32),
            skipped=jnp.zeros((), jnp.int32),
        )

    shapes = jax.eval_shape(build, params)
    shardings = train_state_shardings(shapes, mesh, rules)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def init_train_state(
    graphdef: nnx.GraphDef,
    params: Any,
    optimizer: optax.GradientTransformation,
    rng,
    mesh: Mesh,
    rules: Mapping | None = None,
    frozen: Any = None,
) -> TrainState:
    """Place params on the mesh and build the optimiser state *already sharded* (jitted init).
    `frozen`: with LoRA, the base params (`params` are then the adapters; strata_jax/lora.py)."""
    if frozen is None:
        jax.eval_shape(lambda p: nnx.merge(graphdef, p), params)  # params must fit the graphdef
    else:
        from strata_jax.lora import join

        jax.eval_shape(lambda f, p: nnx.merge(graphdef, join(f, p)), frozen, params)
        frozen = shard_params(frozen, mesh, rules)
    params = shard_params(params, mesh, rules)
    target = abstract_train_state(params, optimizer, mesh, rules)
    shardings = jax.tree.map(lambda s: s.sharding, target)

    def build(p, key):
        return TrainState(
            params=p,
            opt_state=optimizer.init(p),
            step=jnp.zeros((), jnp.int32),
            rng=key,
            skipped=jnp.zeros((), jnp.int32),
        )

    init = jax.jit(build, in_shardings=(shardings.params, replicated(mesh)), out_shardings=shardings)
    return init(params, jax.device_put(_raw_key(rng), replicated(mesh))).replace(frozen=frozen)


# ----------------------------------------------------------------------------------------------
# Forward: per-token log-probs


def sequence_logprobs(
    graphdef,
    params,
    tokens,
    attention_mask,
    chunk_size: int = 8192,
    return_entropy: bool = False,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Teacher-forced log-prob of tokens[s, i] given tokens[s, :i]: [S, L] (column 0 is 0).

    The hidden state at i - 1 predicts token i, so the [S, L - 1] head output is shifted right.
    `window` (static): only the last `window` columns get log-probs (0 elsewhere). Rows end with
    their response (left padding), so a window at least as long as every response covers the whole
    loss; the vocabulary head (and its backward scatter into the embedding) is then paid on
    `window` columns instead of L, most of a small model's step on long prompts.
    """
    model = nnx.merge(graphdef, params)
    hidden, _ = model(tokens, positions_from_mask(attention_mask), attention_mask)  # [S, L, D]
    return _head_logprobs(model, hidden, tokens, chunk_size, return_entropy, window)


def shared_sequence_logprobs(
    graphdef,
    params,
    prefix_tokens,
    prefix_mask,
    row_prefix,
    tokens,
    attention_mask,
    chunk_size: int = 8192,
    return_entropy: bool = False,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """`sequence_logprobs` of rows whose shared prompt prefixes run once (strata_jax/packing.py).

    prefix_tokens / prefix_mask [U, Tpre] (left-padded), row_prefix [S] (row s continues prefix
    row_prefix[s]), tokens / attention_mask [S, Ls] the rows' suffixes (left-padded). The prefixes
    fill a [U, Tpre] KV cache once; each row gets its prefix's keys and values in slots [0, Tpre)
    and runs its suffix at slots [Tpre, Tpre + Ls) against them, at positions that continue from
    the prefix's real length, so every suffix token sees the keys, values and RoPE position it has
    in the unshared row. Gradients flow through the gather into the prefix pass.

    Returns [S, Ls] (and the entropy): the unshared row's log-probs at every suffix token but the
    first real one (its predecessor is the prefix's last token; `pack_shared` leaves a prompt
    token there, never a loss token). `window` as in `sequence_logprobs`, over the suffix columns.
    """
    model = nnx.merge(graphdef, params)
    tpre = prefix_tokens.shape[1]
    cache, pre_mask = _prefix_caches(model, prefix_tokens, prefix_mask, row_prefix, tokens.shape[1])
    pre_len = jnp.sum(pre_mask, axis=1, dtype=jnp.int32)  # [S]
    positions = pre_len[:, None] + positions_from_mask(attention_mask)  # [S, Ls]
    mask = jnp.concatenate([pre_mask, attention_mask.astype(jnp.bool_)], axis=1)  # [S, Tpre + Ls]
    hidden, _ = model(tokens, positions, mask, cache=cache, cache_index=tpre)  # [S, Ls, D]
    return _head_logprobs(model, hidden, tokens, chunk_size, return_entropy, window)


def _prefix_caches(model, prefix_tokens, prefix_mask, row_prefix, extra: int):
    """Run the U prefixes [U, Tpre] once and give each of B rows its prefix's keys and values:
    (cache with per layer [B, K, Tpre + extra, Dh], the rows' prefix masks [B, Tpre])."""
    u, tpre = prefix_tokens.shape
    cache = model.init_cache(u, tpre)
    # Static cache_index 0: the prefixes attend among themselves; last_only: their hidden states
    # are not needed, only the keys and values every layer writes.
    _, cache = model(
        prefix_tokens, positions_from_mask(prefix_mask), prefix_mask, cache=cache, cache_index=0, last_only=True
    )
    return cache.take_rows(row_prefix, extra), jnp.take(prefix_mask, row_prefix, axis=0)


def shared_batch_logprobs(
    graphdef, params, sb: SharedBatch, chunk_size: int = 8192, return_entropy: bool = False, window: int | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """[S, Ls] log-probs (and entropy) of a SharedBatch's rows."""
    return shared_sequence_logprobs(
        graphdef,
        params,
        sb.prefix_tokens,
        sb.prefix_mask,
        sb.row_prefix,
        sb.rows.tokens,
        sb.rows.attention_mask,
        chunk_size,
        return_entropy,
        window,
    )


def tree_logprobs(
    graphdef,
    params,
    tree_tokens,
    tree_positions,
    tree_end,
    slots,
    targets,
    blocks: int = 1,
    chunk_size: int = 8192,
    return_entropy: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """`sequence_logprobs` of rows packed as prefix trees (strata_jax/tree.py): [S, W + 1], column
    c the log-prob of targets[s, c] (the row's last W + 1 tokens; column 0 is 0).

    tree_tokens / tree_positions / tree_end [R, T]: the packed rows, each token at its depth and
    seeing only its path from the root (`Decoder(tree_end=...)`); slots [S, W + 1]: where row s's
    last W + 1 tokens lie among the R / blocks x T slots of its block (`blocks` static, one per
    data-parallel device, so the gather stays on a device). The hidden states are gathered back
    to the rows and the head runs as in `sequence_logprobs` with window W.
    """
    model = nnx.merge(graphdef, params)
    t = tree_tokens.shape[1]
    w1 = slots.shape[1]
    valid = tree_end > jnp.arange(t, dtype=tree_end.dtype)[None, :]  # padding slots have end 0
    hidden, _ = model(tree_tokens, tree_positions, valid, tree_end=tree_end)  # [R, T, D]
    rows_hidden = _gather_rows(hidden, slots, blocks)  # [S, W + 1, D]
    return _head_logprobs(model, rows_hidden, targets, chunk_size, return_entropy, w1 - 1)


def _gather_rows(hidden, slots, blocks: int):
    """[S, C, D]: the hidden states hidden [R, T, D] at each row's flat slots [S, C], where rows and
    packed rows split into `blocks` contiguous blocks (one per data-parallel device) and a row's
    slots index its own block's R / blocks x T slots, so the gather stays on a device."""
    r, t, d = hidden.shape
    s, c = slots.shape
    flat = hidden.reshape(blocks, (r // blocks) * t, d)  # [blocks, R / blocks x T, D]
    where = slots.reshape(blocks, (s // blocks) * c, 1)
    return jnp.take_along_axis(flat, where, axis=1).reshape(s, c, d)


def _head_logprobs(model, hidden, tokens, chunk_size, return_entropy, window):
    """Shifted log-probs (and entropy) [S, L] of tokens from hidden [S, L, D]; see sequence_logprobs."""
    length = tokens.shape[1]
    w = length - 1 if window is None else min(int(window), length - 1)
    logp, ent = token_logprobs(
        hidden[:, -w - 1 : -1], model.unembed_kernel(), tokens[:, -w:], chunk_size, return_entropy
    )  # [S, w]
    pad = lambda x: jnp.pad(x, ((0, 0), (length - w, 0)))  # noqa: E731
    return pad(logp), (pad(ent) if ent is not None else None)


# ----------------------------------------------------------------------------------------------
# Train step


def _global_norm(tree) -> jax.Array:
    tree_api = getattr(optax, "tree", None)  # optax >= 0.2.5; global_norm is deprecated there
    return tree_api.norm(tree) if tree_api is not None and hasattr(tree_api, "norm") else optax.global_norm(tree)


def _split_micro(batch: TokenBatch | SharedBatch, k: int) -> TokenBatch | SharedBatch:
    """[S, ...] -> [k, S / k, ...]; micro-batch j takes rows j, j + k, ... .

    Strided rather than blocked: with S split over devices in contiguous blocks (and S divisible
    by k * devices), every micro-batch stays spread over all devices with no data movement. A
    SharedBatch's prefixes split the same way (strata_jax/packing.py lays them out for it).
    """

    def one(x):
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(one, batch)


def _check_batch(batch: TokenBatch | SharedBatch | TreeRows, micro_batches: int, n_data: int) -> None:
    if isinstance(batch, TreeRows):
        _check_tree(batch, micro_batches, n_data)
        batch = batch.rows
    if isinstance(batch, SharedBatch):
        _check_shared(batch, micro_batches, n_data)
        batch = batch.rows
    s, length = batch.tokens.shape
    for name in ("attention_mask", "loss_mask", "old_logp", "ref_logp", "advantage"):
        if getattr(batch, name).shape != (s, length):
            raise ValueError(f"TokenBatch.{name}: shape {getattr(batch, name).shape} != tokens shape {(s, length)}")
    if batch.row_index.shape != (s, 4) or batch.row_valid.shape != (s,):
        raise ValueError(
            f"TokenBatch.row_index / row_valid: expected [{s}, 4] / [{s}], got "
            f"{batch.row_index.shape} / {batch.row_valid.shape}"
        )
    if s % (micro_batches * n_data):
        raise ValueError(
            f"TokenBatch rows S={s} must be divisible by micro_batches={micro_batches} x "
            f"data-parallel devices={n_data} (pad with row_valid=False rows)"
        )


def _check_shared(batch: SharedBatch, micro_batches: int, n_data: int) -> None:
    if batch.micro_batches != micro_batches:
        raise ValueError(
            f"SharedBatch packed for micro_batches={batch.micro_batches}, but the step runs "
            f"micro_batches={micro_batches} (its row_prefix indexes each micro-batch's own prefixes)"
        )
    u = batch.prefix_tokens.shape[0]
    if batch.prefix_tokens.ndim != 2 or batch.prefix_mask.shape != batch.prefix_tokens.shape:
        raise ValueError(
            f"SharedBatch.prefix_tokens / prefix_mask: expected one [U, Tpre] shape, got "
            f"{batch.prefix_tokens.shape} / {batch.prefix_mask.shape}"
        )
    if u % (micro_batches * n_data):
        raise ValueError(
            f"SharedBatch prefixes U={u} must be divisible by micro_batches={micro_batches} x "
            f"data-parallel devices={n_data}"
        )
    if batch.row_prefix.shape != batch.rows.row_valid.shape:
        raise ValueError(
            f"SharedBatch.row_prefix: expected [{batch.rows.row_valid.shape[0]}], got {batch.row_prefix.shape}"
        )


def _check_tree(batch: TreeRows, micro_batches: int, n_data: int) -> None:
    t = batch.tree
    if batch.micro_batches != micro_batches or t.blocks != n_data:
        raise ValueError(
            f"TreeRows packed for micro_batches={batch.micro_batches} x {t.blocks} data-parallel blocks, "
            f"but the step runs micro_batches={micro_batches} on {n_data} devices (its slots index "
            f"each block's own packed rows)"
        )
    r, width = t.tokens.shape
    for name in ("positions", "end"):
        if getattr(t, name).shape != (r, width):
            raise ValueError(f"TreeRows.tree.{name}: shape {getattr(t, name).shape} != tokens shape {(r, width)}")
    if r % (micro_batches * n_data):
        raise ValueError(
            f"TreeRows.tree: packed rows R={r} must be divisible by micro_batches={micro_batches} x "
            f"data-parallel devices={n_data}"
        )
    if t.slots.shape != batch.rows.tokens.shape or t.targets.shape != batch.rows.tokens.shape:
        raise ValueError(
            f"TreeRows.tree.slots / targets: shapes {t.slots.shape} / {t.targets.shape} != the rows' "
            f"{batch.rows.tokens.shape}"
        )


class TrainStep:
    """`train_step(state, batch, lam_strategy) -> (state, metrics)`: one jax.jit, state donated.

    The jit is built with in/out shardings from the state's logical axes; given `state_shardings`
    it is built now, else at the first call (from that call's state). `.jitted` is the jax.jit
    object (for `.lower(...)`). `lam_strategy` is the weight of strategy rows (traced scalar,
    required: StraTA's lambda; any value for flat algorithms, which have no strategy rows).
    The batch is a global array (multi-host: `sharding.host_local_to_global`) or host numpy: a
    TokenBatch, a SharedBatch (strata_jax/packing.py) or a TreeRows (strata_jax/tree.py), the last
    two packed for this step's micro_batches and data-parallel size; their update equals their
    TokenBatch's up to float rounding. Each batch shape, and each kind, compiles its own program.
    """

    def __init__(
        self,
        step_fn: Callable,
        mesh: Mesh,
        rules,
        micro_batches: int,
        state_shardings: TrainState | None = None,
        compiler_options: dict | None = None,
    ):
        self._fn, self.mesh, self.rules, self._options = step_fn, mesh, rules, compiler_options
        self.micro_batches = micro_batches
        self.jitted = None if state_shardings is None else self._build(state_shardings)

    def _build(self, state_sh: TrainState):
        repl = replicated(self.mesh)
        return jax.jit(
            self._fn,
            in_shardings=(state_sh, data_sharding(self.mesh), repl),
            out_shardings=(state_sh, repl),
            donate_argnums=(0,),
            compiler_options=self._options,
        )

    def __call__(self, state: TrainState, batch: TokenBatch | SharedBatch, lam_strategy):
        # checked here too: jit validates the input shardings before tracing would reach it
        _check_batch(batch, self.micro_batches, self.mesh.shape["data"] * self.mesh.shape["fsdp"])
        if self.jitted is None:
            self.jitted = self._build(train_state_shardings(state, self.mesh, self.rules))
        return self.jitted(state, batch, jnp.asarray(lam_strategy, jnp.float32))


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_cfg: LossConfig,
    mesh: Mesh,
    rules: Mapping | None = None,
    micro_batches: int = 1,
    *,
    logprob_chunk: int = 8192,
    logprob_window: int | None = None,
    state_shardings: TrainState | None = None,
    compiler_options: dict | None = None,
) -> TrainStep:
    """Build the jitted update. See the module docstring for step / skip semantics.

    `compiler_options` go to `jax.jit` (tests on a loaded CPU use a low XLA optimisation level).
    `logprob_window`: see `sequence_logprobs`; the caller guarantees that no `loss_mask` token lies
    before the last `logprob_window` columns (the loss there would silently be 0).
    """
    step_fn = train_step_fn(
        graphdef,
        optimizer,
        loss_cfg,
        mesh,
        rules,
        micro_batches,
        logprob_chunk=logprob_chunk,
        logprob_window=logprob_window,
    )
    return TrainStep(step_fn, mesh, rules, micro_batches, state_shardings, compiler_options)


def train_step_fn(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_cfg: LossConfig,
    mesh: Mesh,
    rules: Mapping | None = None,
    micro_batches: int = 1,
    *,
    logprob_chunk: int = 8192,
    logprob_window: int | None = None,
) -> Callable[[TrainState, TokenBatch, Any], tuple[TrainState, dict]]:
    """The unjitted `step_fn(state, batch, lam_strategy) -> (state, metrics)` that `make_train_step`
    jits: pure, so it can also be vmapped over a stacked [K] state and batch (rollout/population.py).
    The sharding constraints inside it name mesh axes per copy; under vmap the copy axis stays
    unconstrained (replicated).

    The batch is a TokenBatch, a SharedBatch (`shared_sequence_logprobs` then runs its prefixes
    once per micro-batch) or a TreeRows (`tree_logprobs`: its rows as prefix trees); the loss
    (sum, count), metrics and gradient are the same up to float rounding. rollout/population.py
    vmaps it over TokenBatches only (the copies' packed shapes would differ).
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    n_data = mesh.shape["data"] * mesh.shape["fsdp"]
    dsh = data_sharding(mesh)

    def micro_grads(params, frozen, mb: TokenBatch | SharedBatch, lam):
        """Gradient of the loss *sum* on one micro-batch, its count and its metrics. With LoRA
        (`frozen` not None) the gradient is the adapters' alone: the base is not differentiated."""
        rows = mb.rows if isinstance(mb, (SharedBatch, TreeRows)) else mb

        def f(trained):
            if frozen is None:
                p = trained
            else:
                from strata_jax.lora import join

                p = join(frozen, trained)
            if isinstance(mb, TreeRows):
                t = mb.tree
                logp, ent = tree_logprobs(
                    graphdef,
                    p,
                    t.tokens,
                    t.positions,
                    t.end,
                    t.slots,
                    t.targets,
                    t.blocks,
                    logprob_chunk,
                    loss_cfg.needs_entropy,
                )
            elif isinstance(mb, SharedBatch):
                logp, ent = shared_batch_logprobs(
                    graphdef, p, mb, logprob_chunk, loss_cfg.needs_entropy, logprob_window
                )
            else:
                logp, ent = sequence_logprobs(
                    graphdef, p, rows.tokens, rows.attention_mask, logprob_chunk, loss_cfg.needs_entropy, logprob_window
                )
            if ent is not None and not loss_cfg.entropy_bonus:
                ent = jax.lax.stop_gradient(ent)
            loss_sum, count, metrics = policy_loss(logp, rows, loss_cfg, lam, ent)
            return loss_sum, (count, metrics)

        (_, (count, metrics)), g = jax.value_and_grad(f, has_aux=True)(params)
        return g, count, metrics

    def step_fn(state: TrainState, batch: TokenBatch | SharedBatch, lam):
        _check_batch(batch, micro_batches, n_data)
        p_sh = param_shardings(state.params, mesh, rules)
        mbs = _split_micro(batch, micro_batches)

        def body(carry, mb):
            g_acc, c_acc, m_acc = carry
            mb = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, dsh), mb)
            g, c, m = micro_grads(state.params, state.frozen, mb, lam)
            g_acc = jax.tree.map(jnp.add, g_acc, g)
            return (jax.lax.with_sharding_constraint(g_acc, p_sh), c_acc + c, combine_metrics(m_acc, m)), None

        first = jax.tree.map(lambda x: x[0], mbs)
        _, _, m_shape = jax.eval_shape(micro_grads, state.params, state.frozen, first, lam)
        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, state.params), p_sh)
        init = (zeros, jnp.zeros((), jnp.float32), empty_metrics(m_shape))
        (g_sum, count, m_sum), _ = jax.lax.scan(body, init, mbs)

        grads = jax.tree.map(lambda g: g / jnp.maximum(count, 1.0), g_sum)  # divide once
        grad_norm = _global_norm(grads)
        metrics = finalize_metrics(m_sum)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        apply = finite & (count > 0)

        def update(params, opt_state):
            updates, new_opt = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_opt

        # A cond, not a where over old and new: the update then writes the donated params and
        # moments in place, where the select read the old moments after the new ones and XLA
        # copied every moment first (~2% of the tiny model's CPU step). Under a vmap over copies
        # (rollout/population.py) the cond becomes that select again.
        new_params, new_opt = jax.lax.cond(apply, update, lambda p, o: (p, o), state.params, state.opt_state)
        skipped = state.skipped + (~finite).astype(jnp.int32)
        new_state = TrainState(
            params=jax.lax.with_sharding_constraint(new_params, p_sh),
            opt_state=new_opt,
            step=state.step + 1,
            rng=jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0]),
            skipped=skipped,
            frozen=state.frozen,
        )
        metrics.update(
            grad_norm=grad_norm, skipped=skipped, tokens=m_sum["ratio_mean"][1], applied=apply.astype(jnp.int32)
        )
        return new_state, metrics

    return step_fn


# ----------------------------------------------------------------------------------------------
# Mini-batches (host side)


def minibatches(batch: TokenBatch, rows: int, seed: int | None = None) -> Iterator[TokenBatch]:
    """One epoch over `batch` in mini-batches of exactly `rows` rows.

    Rows are shuffled with `seed` (None: kept in order) and the last mini-batch is padded with
    row_valid=False rows, so every mini-batch has the same shape (one compiled step).
    """
    if rows < 1:
        raise ValueError(f"mini-batch rows must be >= 1, got {rows}")
    host = jax.tree.map(np.asarray, batch)
    s = host.tokens.shape[0]
    order = np.arange(s) if seed is None else np.random.default_rng(seed).permutation(s)
    n = -(-s // rows)
    pad = n * rows - s
    order = np.concatenate([order, np.full(pad, -1)])
    for i in range(n):
        idx = order[i * rows : (i + 1) * rows]
        real = idx >= 0
        take = np.where(real, idx, 0)

        def pick(x, name, take=take, real=real):
            if x is None:  # an optional field left empty (TokenBatch.penalty_mask after the gather)
                return None
            y = x[take]
            if name == "row_valid":
                return y & real
            if name in ("loss_mask", "attention_mask"):
                return y & real[:, None]
            return y

        yield TokenBatch(**{f.name: pick(getattr(host, f.name), f.name) for f in dataclasses.fields(TokenBatch)})
