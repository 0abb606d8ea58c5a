"""Padded trajectory pytrees: the data contract between the rollout loop and the jitted update.

Shapes: P tasks, N strategies per task, M trajectories per strategy, H max steps.
Flat algorithms (GRPO, GiGPO, BEACON) use N = 1, M = G.

`anchor_id` / `action_id` are 64-bit hashes of text on the host. JAX runs without x64, where an
int64 array would be silently truncated to int32 (and hashes could collide), so `from_numpy`
relabels them to dense int32 ids with `np.unique`: equality, which is all the advantage code uses,
is preserved exactly. Id -1 (and any negative id) stays "no id".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# field -> (shape letters, numpy dtype kind the caller may pass, dtype stored)
_TRAJ_FIELDS = {
    "step_mask": ("PNMH", "b", jnp.bool_),
    "won": ("PNM", "b", jnp.bool_),
    "episode_return": ("PNM", "f", jnp.float32),
    "env_reward": ("PNMH", "f", jnp.float32),
    "invalid": ("PNMH", "b", jnp.bool_),
    "milestone": ("PNMH", "b", jnp.bool_),
    "judged_bad": ("PNMH", "b", jnp.bool_),
    "anchor_id": ("PNMH", "iu", jnp.int32),
    "action_id": ("PNMH", "iu", jnp.int32),
    "strategy_mask": ("PN", "b", jnp.bool_),
    "strategy_len": ("PN", "iu", jnp.int32),
    "strategy_malformed": ("PN", "b", jnp.bool_),
    "horizon": ("P", "iu", jnp.int32),
}
# Optional fields (docs/CONTRACTS.md "Strategy revision and trained self-judgment"):
# absent from `from_numpy`, they default to zeros / zero-size arrays (R = 0 revisions, J = 0
# judgments), which is a batch without revisions or sampled judgments: every estimator gives the
# numbers it gave before they existed. R comes from revision_mask, J from judge_valid.
_OPTIONAL_FIELDS = {
    "step_slot": ("PNMH", "iu", jnp.int32),  # 0 = z_n governs step t, r+1 = revision r does
    "step_label": ("PNMH", "i", jnp.int32),  # +1 provably good, -1 provably bad, 0 unknown
    "revision_mask": ("PNMR", "b", jnp.bool_),
    "revision_len": ("PNMR", "iu", jnp.int32),
    "revision_malformed": ("PNMR", "b", jnp.bool_),
    "judge_valid": ("PNMJ", "b", jnp.bool_),
    "judge_ok": ("PNMJ", "b", jnp.bool_),
    "judge_sets": ("PNMJH", "b", jnp.bool_),
}
_OPTIONAL_GROUPS = (("revision_mask", "revision_len", "revision_malformed"), ("judge_valid", "judge_ok", "judge_sets"))


class BatchError(ValueError):
    """A batch field has the wrong name, shape or dtype; the message names the field."""


def _dense_ids(x: np.ndarray) -> np.ndarray:
    """Relabel arbitrary integer hashes to dense int32 ids; negative entries stay -1."""
    x = np.asarray(x)
    out = np.full(x.shape, -1, np.int32)
    valid = x >= 0
    if valid.any():
        _, inv = np.unique(x[valid], return_inverse=True)
        out[valid] = inv.astype(np.int32)
    return out


@struct.dataclass
class TrajectoryBatch:
    """One iteration of rollouts. See DESIGN.md for the table of fields."""

    step_mask: jax.Array  # [P, N, M, H] bool
    won: jax.Array  # [P, N, M] bool
    episode_return: jax.Array  # [P, N, M] f32
    env_reward: jax.Array  # [P, N, M, H] f32
    invalid: jax.Array  # [P, N, M, H] bool
    milestone: jax.Array  # [P, N, M, H] bool
    judged_bad: jax.Array  # [P, N, M, H] bool
    anchor_id: jax.Array  # [P, N, M, H] i32 (dense relabel of host int64 hashes)
    action_id: jax.Array  # [P, N, M, H] i32
    strategy_mask: jax.Array  # [P, N] bool
    strategy_len: jax.Array  # [P, N] i32
    strategy_malformed: jax.Array  # [P, N] bool
    horizon: jax.Array  # [P] i32
    # Revision and judgment fields (optional in from_numpy; see _OPTIONAL_FIELDS).
    step_slot: jax.Array | None = None  # [P, N, M, H] i32
    step_label: jax.Array | None = None  # [P, N, M, H] i32 in {-1, 0, 1}
    revision_mask: jax.Array | None = None  # [P, N, M, R] bool
    revision_len: jax.Array | None = None  # [P, N, M, R] i32
    revision_malformed: jax.Array | None = None  # [P, N, M, R] bool
    judge_valid: jax.Array | None = None  # [P, N, M, J] bool: judgment j was sampled
    judge_ok: jax.Array | None = None  # [P, N, M, J] bool: and it parsed
    judge_sets: jax.Array | None = None  # [P, N, M, J, H] bool: step t in I^(j)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(P, N, M, H)."""
        return tuple(self.step_mask.shape)  # type: ignore[return-value]

    @property
    def traj_mask(self) -> jax.Array:
        """[P, N, M] bool: the trajectory exists (has at least one step)."""
        return self.step_mask.any(axis=-1)

    @classmethod
    def from_numpy(cls, **arrays) -> TrajectoryBatch:
        """Validate host arrays (names, shapes, dtypes) and build the pytree.

        Every field of the DESIGN.md table is required; a missing, extra, mis-shaped or mis-typed
        field raises BatchError naming it. The revision and judgment fields (_OPTIONAL_FIELDS) are
        optional (zeros / R = 0 / J = 0 when absent), but the fields of a group (revision_*,
        judge_*) come together.
        """
        allowed = set(_TRAJ_FIELDS) | set(_OPTIONAL_FIELDS)
        missing = sorted(set(_TRAJ_FIELDS) - set(arrays))
        extra = sorted(set(arrays) - allowed)
        if missing:
            raise BatchError(f"TrajectoryBatch: missing field(s) {missing}")
        if extra:
            raise BatchError(f"TrajectoryBatch: unknown field(s) {extra}; allowed: {sorted(allowed)}")
        for group in _OPTIONAL_GROUPS:
            have = [g for g in group if g in arrays]
            if have and len(have) != len(group):
                raise BatchError(f"TrajectoryBatch: fields {list(group)} come together; got only {have}")
        sm = np.asarray(arrays["step_mask"])
        if sm.ndim != 4:
            raise BatchError(f"TrajectoryBatch.step_mask: expected 4 dims [P,N,M,H], got shape {sm.shape}")
        dims = dict(zip("PNMH", sm.shape))
        dims["R"] = np.shape(arrays["revision_mask"])[-1] if "revision_mask" in arrays else 0
        dims["J"] = np.shape(arrays["judge_valid"])[-1] if "judge_valid" in arrays else 0
        out = {}
        for name, (letters, kinds, dtype) in {**_TRAJ_FIELDS, **_OPTIONAL_FIELDS}.items():
            if name not in arrays:  # an optional field left out: its neutral default
                out[name] = jnp.zeros(tuple(dims[c] for c in letters), dtype)
                continue
            a = np.asarray(arrays[name])
            want = tuple(dims[c] for c in letters)
            if a.shape != want:
                raise BatchError(f"TrajectoryBatch.{name}: expected shape [{','.join(letters)}]={want}, got {a.shape}")
            if a.dtype.kind not in kinds:
                raise BatchError(
                    f"TrajectoryBatch.{name}: expected dtype kind {kinds!r} ({np.dtype(dtype).name}), got {a.dtype}"
                )
            if name in ("anchor_id", "action_id"):
                a = _dense_ids(a)
            out[name] = jnp.asarray(a, dtype=dtype)
        return cls(**out)

    @property
    def num_revisions(self) -> int:
        """R, the revision slots per trajectory (0 without revisions)."""
        return 0 if self.revision_mask is None else int(self.revision_mask.shape[-1])

    @property
    def num_judgments(self) -> int:
        """J, the judgments sampled per trajectory (0 when none are recorded)."""
        return 0 if self.judge_valid is None else int(self.judge_valid.shape[-1])


@struct.dataclass
class TokenBatch:
    """What the update sees: one row per trained LLM call (an action step or a strategy).

    `row_index[s] = (p, n, m, t)` points back into the TrajectoryBatch; t = -1 marks a strategy
    row, t <= -2 a strategy revision, t >= H a judgment (`row_kinds`). Padding rows have
    `row_valid = False` and an all-False loss mask.
    """

    tokens: jax.Array  # [S, L] i32, prompt + response, left-padded
    attention_mask: jax.Array  # [S, L] bool, token exists
    loss_mask: jax.Array  # [S, L] bool, response tokens that are trained
    old_logp: jax.Array  # [S, L] f32, log-prob under the sampling policy
    ref_logp: jax.Array  # [S, L] f32, log-prob under the reference policy
    advantage: jax.Array  # [S, L] f32, per-token advantage (filled by gather_advantages)
    row_index: jax.Array  # [S, 4] i32 (p, n, m, t)
    row_valid: jax.Array  # [S] bool
    # [S, L] bool or None: the tokens an invalid step's penalty lands on (rollout/collect.py: the
    # action content of an inadmissible action, the whole response of a format error). None = the
    # whole response (the loss mask).
    penalty_mask: jax.Array | None = None

    @property
    def is_strategy_row(self) -> jax.Array:
        """[S] bool: a strategy or a strategy revision (both weighted by lambda in the loss)."""
        return self.row_index[:, 3] < 0


def row_kinds(t: jax.Array, horizon: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """row_index[:, 3] -> (is_step, is_strategy, is_revision, is_judgment), each [S] bool.

    `0 <= t < H` an action step, `-1` the strategy z_n, `<= -2` revision `-2 - t` of the
    trajectory, `>= H` its judgment `t - H` (docs/CONTRACTS.md).
    """
    return (t >= 0) & (t < horizon), t == -1, t <= -2, t >= horizon


def gather_advantages(
    step_adv: jax.Array,
    strategy_adv: jax.Array,
    tokens: TokenBatch,
    penalty: jax.Array | None = None,
    revision_adv: jax.Array | None = None,
    judge_adv: jax.Array | None = None,
) -> TokenBatch:
    """Copy each row's advantage (step [P,N,M,H], strategy [P,N], revision [P,N,M,R], judgment
    [P,N,M,J]) onto its loss-masked tokens; the row kind comes from row_index[:, 3] (row_kinds).

    `penalty` [P,N,M,H] (the invalid-action penalty inside `step_adv`, see
    strata_jax.advantages.invalid_penalty): with it and a `tokens.penalty_mask`, the penalty lands
    on the penalty-masked tokens only and the rest of the row gets the step's advantage without it.
    Without either, every response token gets the whole step advantage.
    Without `revision_adv`, every t < 0 row is read as a strategy row (a batch without revisions
    or judgments); a revision or judgment row whose array is absent (or has no slots) gets 0.
    """
    H = step_adv.shape[3]
    p, n, m, t = (tokens.row_index[:, i] for i in range(4))
    is_step, is_strat, is_rev, is_judge = row_kinds(t, H)
    if revision_adv is None:
        is_strat, is_rev = t < 0, jnp.zeros_like(is_rev)
    tt = jnp.clip(t, 0, H - 1)
    a_step = step_adv[p, n, m, tt]  # [S]
    a_str = strategy_adv[p, n]  # [S]
    a = jnp.where(is_strat, a_str, jnp.where(is_step, a_step, 0.0))
    if revision_adv is not None and revision_adv.shape[3] > 0:
        r = jnp.clip(-2 - t, 0, revision_adv.shape[3] - 1)
        a = jnp.where(is_rev, revision_adv[p, n, m, r], a)
    if judge_adv is not None and judge_adv.shape[3] > 0:
        j = jnp.clip(t - H, 0, judge_adv.shape[3] - 1)
        a = jnp.where(is_judge, judge_adv[p, n, m, j], a)
    valid = tokens.row_valid
    if penalty is None or tokens.penalty_mask is None:
        a = a * valid  # [S]
        adv = jnp.where(tokens.loss_mask, a[:, None], 0.0)  # [S, L]
        return tokens.replace(advantage=adv.astype(jnp.float32))
    pen = jnp.where(is_step, penalty[p, n, m, tt], 0.0) * valid  # [S]
    base = (a + pen) * valid  # [S]: the step's advantage before the penalty
    on_pen = tokens.loss_mask & tokens.penalty_mask
    adv = jnp.where(tokens.loss_mask, base[:, None], 0.0) - jnp.where(on_pen, pen[:, None], 0.0)
    return tokens.replace(advantage=adv.astype(jnp.float32))


def smallest_bucket(n: int, buckets) -> int | None:
    """The smallest bucket >= n, or None when n exceeds them all. The one lookup behind every
    padded shape (sampler prompts and batches, shared prefixes, token rows, update widths); each
    caller decides what exceeding the largest means (an error, a fallback width)."""
    return next((int(b) for b in sorted(buckets) if b >= n), None)


# --- host-side views of a TokenBatch the update and the scoring cut (pure numpy, no side effects) --


def trim_width(mask: np.ndarray, buckets) -> int:
    """The smallest length bucket holding every row of `mask` [S, L] (rows are left-padded, so the
    last `width` columns carry all tokens). Cutting a mini-batch to it saves the padding compute."""
    need = int(np.asarray(mask).sum(axis=1).max(initial=1))
    b = smallest_bucket(need, buckets)
    return mask.shape[1] if b is None else b


def trim_rows(tb: TokenBatch, buckets) -> TokenBatch:
    """The [S, L] fields cut to the mini-batch's own length bucket (row_index / row_valid kept)."""
    w = trim_width(np.asarray(tb.attention_mask), buckets)
    return tb.replace(
        **{
            f: getattr(tb, f)[:, -w:]
            for f in ("tokens", "attention_mask", "loss_mask", "old_logp", "ref_logp", "advantage")
        }
    )


def check_window(loss_mask: np.ndarray, window: int) -> None:
    """Refuse a loss token before the log-prob window (the last `window` columns, where the update
    and the scoring run the vocabulary head): it would silently get log-prob 0."""
    if loss_mask.shape[1] > window and loss_mask[:, :-window].any():
        raise ValueError(
            f"a trained response is longer than the log-prob window ({window} tokens = the "
            "largest sampling budget); rows must end with their response"
        )


def has_signal(mb: TokenBatch) -> bool:
    """A mini-batch whose loss tokens all have advantage 0 carries no outcome signal: a step on it
    would be the KL and weight-decay terms alone, which AdamW's normalisation turns into a step of
    about lr per parameter (~0.1 nats of drift per row per iteration). The update skips it
    (`train.skip_no_signal`, docs/CONTRACTS.md)."""
    return bool(np.any(np.asarray(mb.advantage)[np.asarray(mb.loss_mask) & np.asarray(mb.row_valid)[:, None]] != 0))


def token_order(tokens: np.ndarray, mask: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """`rows` sorted by their real tokens: rows that share a prompt prefix become neighbours."""
    return np.asarray(sorted(rows, key=lambda r: tokens[r][mask[r]].tolist()), np.int64)


def pad_token_rows(
    prompt_ids, response_ids, response_logp, length: int, num_rows: int, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Pack rows of (prompt, response) into left-padded host arrays for a TokenBatch.

    Row s is `[pad] * k + prompt + response` with k chosen so it ends at `length`; `old_logp[s, i]`
    is the response log-prob of `tokens[s, i]`, 0 on prompt and padding. Rows past the inputs are
    padding (`row_valid` False). A row longer than `length`, or more rows than `num_rows`, raises:
    truncating would silently change what the model was conditioned on.
    Returns tokens [R, L] i32, attention_mask / loss_mask [R, L] bool, old_logp [R, L] f32,
    row_valid [R] bool (R = num_rows, L = length).
    """
    rows = len(prompt_ids)
    if not rows == len(response_ids) == len(response_logp):
        raise ValueError(
            f"pad_token_rows: {len(prompt_ids)} prompts, {len(response_ids)} responses, {len(response_logp)} logp rows"
        )
    if rows > num_rows:
        raise ValueError(f"pad_token_rows: {rows} rows do not fit num_rows={num_rows}")
    lp = np.fromiter((len(x) for x in prompt_ids), np.int64, rows)  # [rows]
    lr = np.fromiter((len(x) for x in response_ids), np.int64, rows)
    lg = np.fromiter((len(x) for x in response_logp), np.int64, rows)
    if (lg != lr).any():
        s = int(np.flatnonzero(lg != lr)[0])
        raise ValueError(f"pad_token_rows: row {s} has {lr[s]} response tokens but {lg[s]} logp")
    if (lp + lr > length).any():
        s = int(np.flatnonzero(lp + lr > length)[0])
        raise ValueError(f"pad_token_rows: row {s} has {lp[s] + lr[s]} tokens > length={length}")
    tokens = np.full((num_rows, length), pad_id, np.int32)
    logp = np.zeros((num_rows, length), np.float32)
    # Scatter all rows at once into the flattened [R * L] arrays (one index array, no row loop).
    flat = [a for pair in zip(prompt_ids, response_ids) for a in pair]
    if rows:
        tokens.reshape(-1)[_right_aligned(lp + lr, length)] = np.concatenate(flat)
        logp.reshape(-1)[_right_aligned(lr, length)] = np.concatenate(response_logp)
    cols = np.arange(length)[None, :]  # [1, L]
    pad = np.full(num_rows, length, np.int64)
    pad[:rows] = length - lp - lr
    resp = np.full(num_rows, length, np.int64)
    resp[:rows] = length - lr
    return {
        "tokens": tokens,
        "attention_mask": cols >= pad[:, None],
        "loss_mask": cols >= resp[:, None],
        "old_logp": logp,
        "row_valid": np.arange(num_rows) < rows,
    }


def _right_aligned(lengths: np.ndarray, width: int) -> np.ndarray:
    """Flat indices into [R, width] of row r's `lengths[r]` elements, right-aligned in the row."""
    first = np.cumsum(lengths) - lengths  # flat input index of each row's first element
    base = np.arange(len(lengths)) * width + width - lengths - first  # [R]
    return np.repeat(base, lengths) + np.arange(int(lengths.sum()))
