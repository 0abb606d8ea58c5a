"""Jitted, sharded sampler with a KV cache, and teacher-forced log-prob scoring.

Two jitted programs per (batch bucket, prompt bucket):
  prefill  runs the left-padded prompt [B, Tp] through the decoder, creates and fills the KV cache
           (capacity Tp + max_new_tokens) and samples the first token;
  decode   a `lax.while_loop` feeding one token per step until every row has finished (EOS id,
           stop sequence, or budget). Its state, KV cache included, is donated: updated in place.

Everything that may change between calls without changing shapes is a traced array: temperature,
top-p, top-k (per row, [B]), EOS ids and stop sequences (padded [n_stop, max_len] + lengths), so a
long run compiles at most 2 programs per (batch bucket, prompt bucket) pair; `Sampler.traces`
counts them (a Python side effect inside the traced functions runs once per trace).

Log-probs. `SampleOutput.logprobs[b, i]` is log softmax(logits)[token] of the *untempered,
untruncated* policy (temperature 1, full vocabulary), whatever temperature / top-k / top-p drew the
token. That is log pi_theta(token | prefix), what the PPO ratio compares against (`old_logp`), and it
equals `score` on the same tokens (exactly up to float error with an f32 model and cache). verl
records log-probs at the sampling temperature instead; with temperature != 1 the behaviour policy
is then not pi_theta, and the caller must know that.

Draws (`draw`): the inverse CDF in two levels, chunk sums then a token inside the chosen chunk,
from two uniforms per row: the softmax's distribution, with one exp and one sum over the
vocabulary (Gumbel-max, `jax.random.categorical`, needs a random number and two logs per entry).
The decode loop runs on weights cast to the compute dtype once and fused per layer
(`qwen2.prepare_decode`; `SamplerConfig.fuse_decode`).

Layout of the cache slots: [0, Tp) hold the left-padded prompt, slot Tp + i holds generated token i.
Positions come from the attention mask: prompt token j sits at cumsum(mask)[j] - 1, generated token
i at prompt_len + i, so left padding does not shift anything.

Shared prefixes (`SamplerConfig.shared_prefix`, strata_jax/prefix.py). Rows whose prompts begin
with the same tokens (the M trajectories of a StraTA strategy) can skip re-encoding them: the
prefill then runs each unique prefix once ([UB, Tpre], a cache of Tpre slots), copies its keys and
values into slots [0, Tpre) of every row that uses it, and runs the rows' suffixes [BB, Ts] at
slots [Tpre, Tp) against them. Positions continue from the prefix (a row's real tokens sit at
0 .. len - 1 either way), Tpre + Ts is the prompt bucket the rows get without sharing, and the
decode program is the same one. The tokens and log-probs are those of the unshared prefill up to
float rounding (tests/test_shared_prefix.py).

Prefix cache across calls (`SamplerConfig.prefix_cache_tokens` > 0; strata_jax/prefix.py
PrefixCache). After each prefill the keys and values of every prompt's first W tokens are copied
into a pool [C, W] kept on the device; a later prompt that starts with c of a cached entry's tokens
takes them from there and prefills only the rest: its cache holds the entry's slots [0, W), those
past its c tokens masked, then its remaining tokens [BB, Ts] at slots [W, W + Ts), positions
continuing from c. Causal attention makes a cached prompt's first c keys and values those of any
prompt with the same first c tokens, so the samples are the uncached prefill's up to float
rounding (tests/test_prefix_cache.py). The pool holds one params' keys and values: a call with
other params (by the identity of its arrays; jax arrays are immutable) clears it first.

The optional embedding is the mean final hidden state (after the last RMSNorm) of the generated
tokens, each taken when the token is fed back in; with `return_embedding` the loop runs one extra
step so the last token of each row is fed too. No second forward pass.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding

from strata_jax import cost, sharding
from strata_jax.batch import smallest_bucket
from strata_jax.models.heads import token_logprobs
from strata_jax.models.qwen2 import positions_from_mask, prepare_decode
from strata_jax.prefix import PrefixCache, plan_prefixes

FINISH_EOS, FINISH_STOP, FINISH_LENGTH = 0, 1, 2


# --------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Static sampler settings: changing any of these compiles new programs.

    prompt_buckets / batch_buckets: ascending lengths / batch sizes that inputs are padded up to;
    empty means powers of two (prompts: 16 .. max_prompt_len, batch: 1 .. max_batch, the last
    bucket being the maximum itself). With a mesh, batch buckets are rounded up to a multiple of
    the data-parallel size.
    """

    max_new_tokens: int = 256
    max_prompt_len: int = 2048
    prompt_buckets: tuple[int, ...] = ()
    max_batch: int = 256
    batch_buckets: tuple[int, ...] = ()
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    cache_dtype: str | None = None  # None: the model's compute dtype; e.g. "bfloat16"
    return_embedding: bool = False
    max_stop_sequences: int = 8  # stop sequences are padded to [max_stop_sequences, max_stop_len]
    max_stop_len: int = 16
    score_chunk: int = 8192  # vocabulary chunk of `score` (heads.token_logprobs)
    shared_prefix: bool = False  # prefill common prompt prefixes once (module docstring)
    prefix_buckets: tuple[int, ...] = ()  # prefix lengths Tpre; empty: powers of two and the prompt buckets
    min_shared_prefix: int = 16  # shorter common prefixes are not worth a copy of their keys and values
    min_prefix_saving: float = 0.2  # share only when the padded prefill shrinks by this fraction
    fuse_decode: bool = True  # decode with fused q/k/v and gate/up kernels (qwen2.prepare_decode)
    prefix_cache_tokens: int = 0  # W: cache each prompt's first W tokens across calls (0: off; module docstring)
    prefix_cache_bytes: int = 512 << 20  # the pool's size limit: C = bytes // (one row's keys and values)
    suffix_buckets: tuple[int, ...] = ()  # lengths after a cached prefix; empty: half octaves from 16

    def __post_init__(self):
        for name in (
            "max_new_tokens",
            "max_prompt_len",
            "max_batch",
            "max_stop_sequences",
            "max_stop_len",
            "score_chunk",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"SamplerConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prompt_buckets", "batch_buckets"):
            b = tuple(getattr(self, name))
            if b and (list(b) != sorted(set(b)) or b[0] < 1):
                raise ValueError(f"SamplerConfig.{name} must be strictly ascending positive ints, got {b}")
        if int(self.prefix_cache_tokens) < 0 or int(self.prefix_cache_bytes) < 0:
            raise ValueError(
                f"SamplerConfig.prefix_cache_tokens / prefix_cache_bytes must be >= 0, got "
                f"{self.prefix_cache_tokens} / {self.prefix_cache_bytes}"
            )
        if any(int(e) < 0 for e in self.eos_ids):
            raise ValueError(f"SamplerConfig.eos_ids must be >= 0, got {self.eos_ids}")

    def prompt_bucket_list(self) -> tuple[int, ...]:
        return tuple(self.prompt_buckets) or power_of_two_buckets(16, self.max_prompt_len)

    def prefix_bucket_list(self) -> tuple[int, ...]:
        if self.prefix_buckets:
            return tuple(self.prefix_buckets)
        return tuple(sorted(set(power_of_two_buckets(32, self.max_prompt_len)) | set(self.prompt_bucket_list())))

    def suffix_bucket_list(self) -> tuple[int, ...]:
        """Remaining-prompt lengths after a cached prefix: 16, 24, 32, 48, ... (at most a third of
        padding), up to max_prompt_len."""
        if self.suffix_buckets:
            return tuple(self.suffix_buckets)
        out, b = set(), 16
        while b < self.max_prompt_len:
            out |= {b, b + b // 2}
            b *= 2
        return tuple(sorted(x for x in out if x < self.max_prompt_len)) + (int(self.max_prompt_len),)

    def batch_bucket_list(self, multiple: int = 1) -> tuple[int, ...]:
        base = tuple(self.batch_buckets) or power_of_two_buckets(1, self.max_batch)
        return tuple(sorted({-(-b // multiple) * multiple for b in base}))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings; each a scalar or one value per prompt. All traced (no recompile).

    temperature 0 = greedy. top_k 0 = no top-k. top_p 1 = no nucleus truncation. Order as in
    transformers: temperature, then top-k, then top-p on the top-k-renormalised distribution.
    """

    temperature: float | Sequence[float] = 1.0
    top_p: float | Sequence[float] = 1.0
    top_k: int | Sequence[int] = 0


@dataclasses.dataclass
class SampleOutput:
    """Host (numpy) results for the B prompts. T = max_new_tokens."""

    tokens: np.ndarray  # [B, T] int32; pad_id after a row finished
    logprobs: np.ndarray  # [B, T] f32; log pi(token) at temperature 1, 0 after a row finished
    lengths: np.ndarray  # [B] int32; generated tokens, the EOS / stop sequence included
    finish_reason: np.ndarray  # [B] int32; FINISH_EOS, FINISH_STOP or FINISH_LENGTH
    embedding: np.ndarray | None  # [B, D] f32 mean final hidden state of the generated tokens


def power_of_two_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """(lo, 2 lo, 4 lo, ..., hi): hi is always the last bucket even if not a power of two."""
    out, b = [], max(1, int(lo))
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (int(hi),)


def pick_bucket(n: int, buckets: Sequence[int], what: str) -> int:
    """Smallest bucket >= n; a clear error when n exceeds the largest."""
    b = smallest_bucket(n, buckets)
    if b is not None:
        return b
    raise ValueError(
        f"{what} {n} exceeds the largest bucket {buckets[-1]} (buckets: {tuple(buckets)}); "
        f"raise the SamplerConfig limit or shorten the input"
    )


# ----------------------------------------------------------------------------- token selection


def truncation_mask_sorted(sorted_logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Which ranks survive top-k then top-p, for logits sorted descending. [B, V] bool.

    top-p keeps the smallest prefix whose mass reaches p: rank r stays iff the mass strictly before
    it is < p, so rank 0 always stays.
    """
    b, v = sorted_logits.shape
    rank = jax.lax.broadcasted_iota(jnp.int32, (b, v), 1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)  # [B]
    keep_k = rank < k[:, None]
    probs = jax.nn.softmax(jnp.where(keep_k, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return keep_k & (mass_before < top_p[:, None])


def argmax_last(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, axis=-1) for [B, V] (the first index of the maximum) as two plain reductions,
    max then min-index. XLA-CPU runs argmax's (value, index) pair reduction as a slow scalar loop:
    at the bench's batch 32, V = 512 the two argmaxes of a decode step (greedy and the Gumbel-max
    draw the sampler used then) took ~1 ms of a 3.6 ms step (bench/sampler.py, docs/BENCHMARKS.md)."""
    v = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    # NaN rows (top NaN) match nowhere: clamp to a valid id instead of returning V.
    return jnp.minimum(jnp.min(jnp.where(x == top, iota, v), axis=-1), v - 1)


def draw_chunk(v: int) -> int:
    """Chunk width of `draw` for a vocabulary of v: the power of two at or above sqrt(v), so that
    both levels are short (152k tokens: 297 chunks of 512)."""
    c = 1
    while c * c < v:
        c *= 2
    return min(c, v)


def _inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """weights [B, n] >= 0, u [B] in (0, 1] -> [B] int32: the first i with cumsum(w)[i] >= u * sum(w).

    Such an i has weight > 0 (the cumsum rises there), so a zero-weight entry is never chosen; when
    rounding puts u * sum above the last cumsum, the last positive entry is taken."""
    cum = jnp.cumsum(weights, axis=-1)
    target = u * cum[:, -1]
    idx = jnp.sum(cum < target[:, None], axis=-1, dtype=jnp.int32)
    last = jnp.max(jnp.where(weights > 0, jax.lax.broadcasted_iota(jnp.int32, weights.shape, 1), 0), axis=-1)
    return jnp.minimum(idx, last)


def draw_with_uniforms(logits: jax.Array, u: jax.Array) -> jax.Array:
    """One token per row from softmax(logits) [B, V] f32 (-inf: excluded), by inverting the CDF
    with two uniforms u [2, B] in (0, 1]. Returns [B] int32.

    Two levels, so that nothing runs over the vocabulary but one exp and one sum: the
    probabilities are summed in chunks of `draw_chunk(V)` tokens, u[0] picks a chunk by its sum,
    u[1] picks a token inside it. P(token) = P(chunk) * P(token | chunk) = softmax(logits)[token].
    Gumbel-max (`jax.random.categorical`) draws the same distribution, but needs a random number
    and two logs per vocabulary entry: a decode step at batch 32 and 152k tokens took 50 ms with
    it and 17 ms with this on the CPU (docs/BENCHMARKS.md, "Sampler").
    """
    b, v = logits.shape
    c = draw_chunk(v)
    n = -(-v // c)
    x = jnp.pad(logits, ((0, 0), (0, n * c - v)), constant_values=-jnp.inf)
    top = jnp.max(x, axis=-1, keepdims=True)
    p = jnp.exp(x - top).reshape(b, n, c)  # unnormalised, the largest 1
    chunk = _inverse_cdf(jnp.sum(p, axis=-1), u[0])  # [B]
    inside = jnp.take_along_axis(p, chunk[:, None, None], axis=1)[:, 0]  # [B, C]
    return chunk * c + _inverse_cdf(inside, u[1])


def draw(key: jax.Array, logits: jax.Array) -> jax.Array:
    """A sample from softmax(logits) per row of [B, V] (see draw_with_uniforms). Returns [B] int32."""
    u = 1.0 - jax.random.uniform(key, (2, logits.shape[0]), jnp.float32)  # (0, 1]
    return draw_with_uniforms(logits, u)


def _sample_full(scaled, key, top_k, top_p):
    del top_k, top_p
    return draw(key, scaled)


def _sample_truncated(scaled, key, top_k, top_p):
    # Sample in sorted space (exact top-k by rank, no scatter back), then map the rank to a token.
    b, v = scaled.shape
    iota = jax.lax.broadcasted_iota(jnp.int32, (b, v), 1)
    neg_sorted, order = jax.lax.sort((-scaled, iota), dimension=1, num_keys=1)
    sorted_logits = -neg_sorted
    keep = truncation_mask_sorted(sorted_logits, top_k, top_p)
    rank = draw(key, jnp.where(keep, sorted_logits, -jnp.inf))
    return jnp.take_along_axis(order, rank[:, None], axis=1)[:, 0].astype(jnp.int32)


def sample_tokens(
    logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """One token per row from logits [B, V] f32 with per-row settings [B]. Returns [B] int32.

    The full-vocabulary sort that top-k / top-p need is skipped (`lax.cond`) when no sampled row
    asks for truncation, which is the usual RL setting (temperature 1, no truncation); the greedy
    argmax (two more passes over [B, V]) is skipped when no row is greedy (temperature 0).
    """
    sampled_row = temperature > 0
    greedy = jax.lax.cond(jnp.all(sampled_row), lambda x: jnp.zeros(x.shape[:1], jnp.int32), argmax_last, logits)
    scaled = logits / jnp.where(sampled_row, temperature, 1.0)[:, None]
    truncate = jnp.any(sampled_row & ((top_k > 0) | (top_p < 1.0)))
    sampled = jax.lax.cond(truncate, _sample_truncated, _sample_full, scaled, key, top_k, top_p)
    return jnp.where(sampled_row, sampled, greedy)


def stop_sequence_hit(window: jax.Array, stop_tokens: jax.Array, stop_lens: jax.Array) -> jax.Array:
    """Does the generated suffix end with any stop sequence? [B] bool.

    window [B, W]: the last W generated tokens, right-aligned, -1 where nothing was generated yet
    (so a sequence never matches across the prompt boundary). stop_tokens [S, W]: each sequence
    right-aligned (its last stop_lens[s] columns); rows with stop_lens 0 are padding.
    """
    w = stop_tokens.shape[1]
    relevant = jnp.arange(w)[None, :] >= (w - stop_lens)[:, None]  # [S, W]
    eq = (window[:, None, :] == stop_tokens[None]) | ~relevant[None]  # [B, S, W]
    return jnp.any(eq.all(-1) & (stop_lens > 0)[None], axis=-1)


# ----------------------------------------------------------------------------- jitted state


@struct.dataclass
class _Consts:
    """Per-call inputs that stay fixed during decoding."""

    prompt_mask: jax.Array  # [B, Tp] bool
    prompt_len: jax.Array  # [B] i32
    row_valid: jax.Array  # [B] bool (False: batch-bucket padding row)
    temperature: jax.Array  # [B] f32
    top_k: jax.Array  # [B] i32
    top_p: jax.Array  # [B] f32
    stop_tokens: jax.Array  # [S, W] i32, right-aligned
    stop_lens: jax.Array  # [S] i32
    eos_ids: jax.Array  # [E] i32, -1 padded


@struct.dataclass
class _State:
    cache: Any  # KVCache
    step: jax.Array  # () i32: generated token `step` is the next one fed to the model
    tokens: jax.Array  # [B, N] i32
    logprobs: jax.Array  # [B, N] f32
    lengths: jax.Array  # [B] i32
    done: jax.Array  # [B] bool
    reason: jax.Array  # [B] i32
    window: jax.Array  # [B, W] i32, last W generated tokens
    emb_sum: jax.Array  # [B, D] f32
    rng: jax.Array


def _last_logits(hidden: jax.Array, kernel: jax.Array) -> jax.Array:
    """[B, D] x [D, V] -> [B, V] f32, accumulating in f32 without upcasting the weights."""
    return jnp.dot(hidden, kernel.astype(hidden.dtype), preferred_element_type=jnp.float32)


def _record(s: _State, tok: jax.Array, logits: jax.Array, c: _Consts) -> _State:
    """Write token number `s.lengths` for rows still running; update stop state."""
    active = ~s.done  # [B]
    n = s.tokens.shape[1]
    # logits[tok] - logsumexp: no [B, V] log-softmax written out.
    lp = jnp.take_along_axis(logits, tok[:, None], axis=1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
    # One-hot column write (not .at[i]): rows are at their own length, and no clamping surprises.
    col = (jnp.arange(n)[None, :] == s.lengths[:, None]) & active[:, None]  # [B, N]
    tokens = jnp.where(col, tok[:, None], s.tokens)
    logprobs = jnp.where(col, lp[:, None], s.logprobs)
    lengths = s.lengths + active.astype(jnp.int32)
    window = jnp.concatenate([s.window[:, 1:], tok[:, None]], axis=1)
    window = jnp.where(active[:, None], window, s.window)
    is_eos = jnp.any(tok[:, None] == c.eos_ids[None, :], axis=-1)
    is_stop = stop_sequence_hit(window, c.stop_tokens, c.stop_lens)
    full = lengths >= n
    reason = jnp.where(is_eos, FINISH_EOS, jnp.where(is_stop, FINISH_STOP, FINISH_LENGTH))
    finished = active & (is_eos | is_stop | full)
    # Tokens start as pad_id and finished rows are never written again: padding after the end.
    return s.replace(
        tokens=tokens,
        logprobs=logprobs,
        lengths=lengths,
        window=window,
        done=s.done | finished,
        reason=jnp.where(finished, reason, s.reason),
    )


# ----------------------------------------------------------------------------------- sampler


class Sampler:
    """Jitted prefill + while-loop decode over a fixed model graph. See the module docstring."""

    def __init__(self, graphdef: Any, config: SamplerConfig, mesh: Mesh | None = None):
        self.graphdef = graphdef
        self.config = config
        self.mesh = mesh
        dp = 1 if mesh is None else int(np.prod([mesh.shape[a] for a in sharding.DEFAULT_RULES["batch"]]))
        self.prompt_buckets = config.prompt_bucket_list()
        self.batch_buckets = config.batch_bucket_list(dp)
        self.traces: Counter = Counter()  # traces (= compilations) per jitted function
        self._prefill = jax.jit(self._prefill_impl)
        self._prefill_shared = jax.jit(self._prefill_shared_impl)
        # Padded prefill tokens (rows x slots) run so far, and how many of the calls shared prefixes.
        self.prefill_tokens = 0
        self.shared_calls = 0
        # Every call's model work from its padded shapes (strata_jax/cost.py): bench/iteration.py
        # models an iteration's time at another model's size from it.
        self.work = cost.Work()
        self._decode = jax.jit(self._decode_impl, donate_argnums=(1,))
        self._score = jax.jit(self._score_impl)
        # Wall seconds of the prefills and the decodes (generate waits for the prefill's result).
        self.seconds: Counter = Counter()
        # The cross-call prefix cache (module docstring): host bookkeeping, then the device pool
        # [C, W], allocated at the first call (its row size comes from the model).
        self.prefix_cache: PrefixCache | None = None
        self.cache_stats: Counter = Counter()  # calls, hit_rows, reused_tokens, stored
        self._pool = None
        self._pool_refs: list | None = None  # weak references to the params the pool was computed with
        self._prefill_cached = jax.jit(self._prefill_cached_impl)
        self._store = jax.jit(self._store_impl, donate_argnums=(0,))
        self._dp = dp

    @property
    def num_compiles(self) -> int:
        """Programs traced so far (prefill + decode + score)."""
        return sum(self.traces.values())

    # -------------------------------------------------------------------------- public API

    def generate(
        self,
        params: Any,
        prompts: list[list[int]],
        sampling: SamplingParams,
        rng: Any,
        stop_sequences: list[list[int]] | None = None,
    ) -> SampleOutput:
        """Sample up to max_new_tokens per prompt. See SampleOutput for the result."""
        cfg = self.config
        _check_prompts(prompts)
        hits = None
        if cfg.prefix_cache_tokens > 0:
            self._check_pool(params)
            hits = [self.prefix_cache.match(p) for p in prompts]
        t0 = time.perf_counter()
        tokens, consts, key, path, mask = self._prepare(prompts, sampling, rng, stop_sequences, hits)  # validates
        b = len(prompts)
        if path == "plain":
            state = self._prefill(params, tokens, consts, key)
        elif path == "shared":
            state = self._prefill_shared(params, *tokens, consts, key)
        else:
            state = self._prefill_cached(params, self._pool, *tokens, consts, key)
        if hits is not None:
            self._store_heads(state, prompts, hits, mask)
        jax.block_until_ready(state)
        t1 = time.perf_counter()
        self.seconds["prefill"] += t1 - t0
        state = self._decode(params, state, consts)
        host = jax.device_get(
            {
                "tokens": state.tokens,
                "logprobs": state.logprobs,
                "lengths": state.lengths,
                "reason": state.reason,
                "emb": state.emb_sum,
                "step": state.step,
            }
        )
        rows, n = state.tokens.shape
        self.work.add_decode(rows, int(host["step"]), int(consts.prompt_mask.shape[1]) + n)
        lengths = host["lengths"][:b]
        emb = None
        if cfg.return_embedding:
            emb = (host["emb"][:b] / np.maximum(lengths, 1)[:, None]).astype(np.float32)
        self.seconds["decode"] += time.perf_counter() - t1
        return SampleOutput(
            tokens=host["tokens"][:b],
            logprobs=host["logprobs"][:b],
            lengths=lengths,
            finish_reason=host["reason"][:b],
            embedding=emb,
        )

    def clear_prefix_cache(self) -> None:
        """Forget every cached prompt head (the pool's memory stays allocated for the next ones)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _check_pool(self, params) -> None:
        """Allocate the pool at the first call; clear the cache when `params` are not the arrays
        its keys and values were computed with."""
        leaves = jax.tree.leaves(params)
        refs = self._pool_refs
        if refs is None or len(refs) != len(leaves) or any(r() is not x for r, x in zip(refs, leaves)):
            self.clear_prefix_cache()
            self._pool_refs = [_weak(x) for x in leaves]
        if self._pool is not None:
            return
        cfg = self.config
        w = int(cfg.prefix_cache_tokens)
        dtype = _dtype(cfg.cache_dtype)

        def pool(p, rows: int):
            return nnx.merge(self.graphdef, p).init_cache(rows, w, dtype=dtype)

        one_row = jax.eval_shape(functools.partial(pool, rows=1), params)
        row_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(one_row))
        rows = min(int(cfg.prefix_cache_bytes) // row_bytes, 2 * max(self.batch_buckets))
        rows -= rows % self._dp
        if rows < 1:
            raise ValueError(
                f"SamplerConfig.prefix_cache_bytes = {cfg.prefix_cache_bytes} holds no row of the "
                f"prefix cache: one row of {w} tokens' keys and values takes {row_bytes} bytes "
                f"(x {self._dp} data-parallel rows); raise it or lower prefix_cache_tokens"
            )
        self.prefix_cache = PrefixCache(rows, w, int(cfg.min_shared_prefix))
        self._pool = self._constrain_cache(jax.jit(functools.partial(pool, rows=rows))(params))

    def _store_heads(self, state: _State, prompts, hits, mask: np.ndarray) -> None:
        """Copy the call's new prompt heads from its prefill cache into the pool (PrefixCache.assign
        says which, and where). `mask` [BB, Tp] is the prefill's prompt mask on the host: row i's
        prompt token j sits in its j-th unmasked slot, whichever path filled it."""
        stores = self.prefix_cache.assign(prompts, hits)
        self.cache_stats["calls"] += 1
        self.cache_stats["hit_rows"] += sum(e is not None for e, _ in hits)
        self.cache_stats["reused_tokens"] += sum(n for _, n in hits)
        if not stores:
            return
        self.cache_stats["stored"] += len(stores)
        bb, w = mask.shape[0], self.prefix_cache.width
        dst = np.full((bb,), self.prefix_cache.rows, np.int32)  # out of range: not stored (dropped)
        src = np.zeros((bb, w), np.int32)
        valid = np.zeros((bb, w), bool)
        for i, row, h in stores:
            dst[i] = row
            src[i, w - h :] = np.flatnonzero(mask[i])[:h]  # left-padded in the pool, like a prompt
            valid[i, w - h :] = True
        self._pool = self._store(self._pool, state.cache, jnp.asarray(dst), jnp.asarray(src), jnp.asarray(valid))

    def _cached_layout(self, prompts, hits, bb: int):
        """The cached prefill's inputs: (row_entry [BB], prefix mask [BB, W], suffixes) and the
        suffix bucket Ts, or None when a remaining prompt does not fit the suffix buckets."""
        w = self.prefix_cache.width
        rest = [len(p) - n for p, (_, n) in zip(prompts, hits)]
        ts = smallest_bucket(max(rest), self.config.suffix_bucket_list())
        if ts is None:
            return None
        row_entry = np.zeros((bb,), np.int32)
        pre_mask = np.zeros((bb, w), bool)
        for i, (e, n) in enumerate(hits):
            if e is not None:
                row_entry[i] = e.row
                start = w - len(e.tokens)  # the entry's token j sits in pool slot start + j
                pre_mask[i, start : start + n] = True
        return row_entry, pre_mask, [list(p[n:]) for p, (_, n) in zip(prompts, hits)], ts

    def _prepare(self, prompts, sampling: SamplingParams, rng, stop_sequences, hits=None):
        """Validate and bucket-pad the host inputs; place them on the mesh. Returns (tokens, consts,
        key, path, mask): path "plain", "shared" (prefixes shared within the call) or "cached"
        (prefixes from the cross-call pool), whichever runs the fewest padded prompt tokens, and
        mask the host prompt mask [BB, Tp]."""
        cfg = self.config
        b = _check_prompts(prompts)
        bb = pick_bucket(b, self.batch_buckets, "batch size")
        tp = pick_bucket(max(len(p) for p in prompts), self.prompt_buckets, "prompt length")
        plan = cached = None
        if cfg.shared_prefix:
            plan = plan_prefixes(
                prompts,
                tp,
                bb,
                cfg.prefix_bucket_list(),
                self.batch_buckets,
                cfg.min_shared_prefix,
                cfg.min_prefix_saving,
            )
        if hits is not None and any(e is not None for e, _ in hits):
            cached = self._cached_layout(prompts, hits, bb)
            if cached is not None and bb * cached[-1] >= (bb * tp if plan is None else plan.cost):
                cached = None  # no fewer tokens than without the pool
        if cached is not None:
            row_entry, pre_mask, rest, ts = cached
            suf_tokens, suf_mask = _left_pad(rest, bb, ts, cfg.pad_id)
            mask = np.concatenate([pre_mask, suf_mask], axis=1)
            tokens = (row_entry, suf_tokens)
            self.prefill_tokens += bb * ts
            self.work.add(**cost.prefixed(0, pre_mask.shape[1], bb, ts, 1))
            path = "cached"
        elif plan is None:
            path = "plain"
            tokens, mask = _left_pad(prompts, bb, tp, cfg.pad_id)
            self.prefill_tokens += bb * tp
            self.work.add(**cost.dense(bb, tp, 1))
        else:
            path = "shared"
            # [UB, Tpre] prefixes and [BB, Ts] suffixes, each left-padded; the row's prompt mask is
            # its prefix's mask followed by its suffix's, [BB, Tpre + Ts = Tp].
            pre_tokens, pre_mask = _left_pad(
                [list(x) for x in plan.prefixes], plan.unique_bucket, plan.prefix_bucket, cfg.pad_id
            )
            pre_mask[len(plan.prefixes) :] = False
            suf_tokens, suf_mask = _left_pad(
                [list(p[s:]) for p, s in zip(prompts, plan.split)], bb, plan.suffix_bucket, cfg.pad_id
            )
            row_prefix = np.zeros((bb,), np.int32)
            row_prefix[:b] = plan.row_prefix
            mask = np.concatenate([pre_mask[row_prefix], suf_mask], axis=1)
            tokens = (pre_tokens, pre_mask, row_prefix, suf_tokens)
            self.prefill_tokens += plan.cost
            self.shared_calls += 1
            self.work.add(**cost.prefixed(plan.unique_bucket, plan.prefix_bucket, bb, plan.suffix_bucket, 1))
        self.work.add(**cost.real(list(map(len, prompts))))
        consts = _Consts(
            prompt_mask=mask,
            prompt_len=mask.sum(1).astype(np.int32),
            row_valid=np.arange(bb) < b,
            **_sampling_arrays(sampling, b, bb),
            **_stop_arrays(stop_sequences, cfg.max_stop_sequences, cfg.max_stop_len),
            eos_ids=np.asarray(list(cfg.eos_ids) or [-1], np.int32),
        )
        tokens, consts = self._place(tokens, consts)
        key = jax.random.key(rng) if isinstance(rng, (int, np.integer)) else rng
        return tokens, consts, key, path, mask

    def score(self, params: Any, tokens: Any, attention_mask: Any) -> np.ndarray:
        """Teacher-forced log-probs [B, L] (see `score`), bucketed with this sampler's buckets."""
        tokens, mask = _check_score_inputs(tokens, attention_mask)
        b, length = tokens.shape
        bb = pick_bucket(b, self.batch_buckets, "batch size")
        tokens, mask = _pad_for_score(tokens, mask, bb, _next_pow2(max(length, 16)), self.config.pad_id)
        self.work.add(**cost.dense(*tokens.shape, tokens.shape[1]), **cost.real(np.asarray(mask).sum(axis=1)))
        if self.mesh is not None:
            spec = sharding.data_sharding(self.mesh)
            tokens, mask = jax.device_put(tokens, spec), jax.device_put(mask, spec)
        return np.asarray(jax.device_get(self._score(params, tokens, mask)))[:b, :length]

    # -------------------------------------------------------------------------- jitted bodies

    def _prefill_impl(self, params, tokens, c: _Consts, rng) -> _State:
        self.traces["prefill"] += 1  # Python side effect: runs once per trace
        cfg = self.config
        model = nnx.merge(self.graphdef, params)
        b, tp = tokens.shape
        n = cfg.max_new_tokens
        cache = model.init_cache(b, tp + n, dtype=_dtype(cfg.cache_dtype))
        cache = self._constrain_cache(cache)
        positions = positions_from_mask(c.prompt_mask)
        mask = jnp.concatenate([c.prompt_mask, jnp.zeros((b, n), jnp.bool_)], axis=1)  # [B, S]
        # Static cache_index 0: attention over the Tp prompt slots only; last_only: the last layer
        # and the norm run on the last position only (its logits are all the prefill needs).
        hidden, cache = model(tokens, positions, mask, cache=cache, cache_index=0, last_only=True)
        return self._first_token(model, hidden[:, -1], cache, c, rng)

    def _prefill_shared_impl(self, params, pre_tokens, pre_mask, row_prefix, suf_tokens, c: _Consts, rng) -> _State:
        """The prefill over shared prefixes (module docstring). pre_tokens / pre_mask [UB, Tpre],
        row_prefix [BB] (each row's prefix), suf_tokens [BB, Ts]; c.prompt_mask is [BB, Tpre + Ts]."""
        self.traces["prefill_shared"] += 1
        model = nnx.merge(self.graphdef, params)
        u, tpre = pre_tokens.shape
        dtype = _dtype(self.config.cache_dtype)
        pre_pos = positions_from_mask(pre_mask)
        pre_cache = model.init_cache(u, tpre, dtype=dtype)
        _, pre_cache = model(pre_tokens, pre_pos, pre_mask, cache=pre_cache, cache_index=0, last_only=True)
        return self._prefill_after(model, pre_cache, row_prefix, suf_tokens, c, rng)

    def _prefill_cached_impl(self, params, pool, row_entry, suf_tokens, c: _Consts, rng) -> _State:
        """The prefill from the cross-call pool (module docstring): pool [C, W], row_entry [BB] (each
        row's entry; its usable slots are c.prompt_mask[:, :W]), suf_tokens [BB, Ts]."""
        self.traces["prefill_cached"] += 1
        return self._prefill_after(nnx.merge(self.graphdef, params), pool, row_entry, suf_tokens, c, rng)

    def _prefill_after(self, model, pre_cache, row_prefix, suf_tokens, c: _Consts, rng) -> _State:
        """Rows' suffixes [BB, Ts] against prefixes already in a cache [U, Tpre]: row b starts from
        prefix row_prefix[b], its slots masked by c.prompt_mask[:, :Tpre]."""
        tpre = pre_cache.capacity
        b, ts = suf_tokens.shape
        n = self.config.max_new_tokens
        # Each row's cache: its prefix's keys and values in slots [0, Tpre), the rest empty.
        cache = pre_cache.take_rows(row_prefix, ts + n)
        cache = self._constrain_cache(cache)
        suf_mask = c.prompt_mask[:, tpre:]
        pre_len = jnp.sum(c.prompt_mask[:, :tpre], axis=1, dtype=jnp.int32)  # [BB]
        suf_pos = pre_len[:, None] + positions_from_mask(suf_mask)
        mask = jnp.concatenate([c.prompt_mask, jnp.zeros((b, n), jnp.bool_)], axis=1)  # [BB, S]
        hidden, cache = model(suf_tokens, suf_pos, mask, cache=cache, cache_index=tpre, last_only=True)
        return self._first_token(model, hidden[:, -1], cache, c, rng)

    def _store_impl(self, pool, cache, dst, src, valid):
        """pool [C, W] <- the prefill cache's rows [BB, S]: row i's slots src[i] ([BB, W], zero
        where not valid) into pool row dst[i] (dst = C: dropped). Donates the pool."""
        self.traces["store"] += 1

        def one(p, x):
            axis = x.ndim - 4  # the batch axis: 0, or 1 under scan_layers
            idx = src.reshape((1,) * axis + (src.shape[0], 1, src.shape[1], 1))
            rows = jnp.take_along_axis(x, idx, axis=x.ndim - 2)  # [.., BB, K, W, Dh]
            keep = valid.reshape(idx.shape)
            rows = jnp.where(keep, rows, jnp.zeros((), rows.dtype)).astype(p.dtype)
            at = (slice(None),) * axis + (dst,)
            return p.at[at].set(rows, mode="drop")

        return self._constrain_cache(jax.tree.map(one, pool, cache))

    def _first_token(self, model, last_hidden, cache, c: _Consts, rng) -> _State:
        """Sample the first token from the prompt's last hidden state [B, D]; the decode's start state."""
        cfg = self.config
        b = last_hidden.shape[0]
        n = cfg.max_new_tokens
        cache = self._constrain_cache(cache)
        logits = _last_logits(last_hidden, model.unembed_kernel())  # [B, V]
        rng, key = jax.random.split(rng)
        tok = sample_tokens(logits, key, c.temperature, c.top_k, c.top_p)
        w = c.stop_tokens.shape[1]
        state = _State(
            cache=cache,
            step=jnp.int32(0),
            tokens=jnp.full((b, n), cfg.pad_id, jnp.int32),
            logprobs=jnp.zeros((b, n), jnp.float32),
            lengths=jnp.zeros((b,), jnp.int32),
            done=~c.row_valid,
            reason=jnp.full((b,), FINISH_LENGTH, jnp.int32),
            window=jnp.full((b, w), -1, jnp.int32),
            emb_sum=jnp.zeros((b, last_hidden.shape[-1]), jnp.float32),
            rng=rng,
        )
        return _record(state, tok, logits, c)

    def _decode_impl(self, params, state: _State, c: _Consts) -> _State:
        self.traces["decode"] += 1
        cfg = self.config
        # Weights cast to the compute dtype and fused once, before the loop reads them every step.
        model = prepare_decode(nnx.merge(self.graphdef, params), fuse=cfg.fuse_decode)
        kernel = model.unembed_kernel()
        b, n = state.tokens.shape
        tp = c.prompt_mask.shape[1]

        def pending(s: _State) -> jax.Array:  # [B]: rows that still need a forward step
            p = ~s.done
            if cfg.return_embedding:  # generated token `step` not yet fed for its hidden state
                p = p | (s.step < s.lengths)
            return p

        def cond(s: _State) -> jax.Array:
            return jnp.any(pending(s)) & (s.step < n)

        def body(s: _State) -> _State:
            i = s.step
            tok = jax.lax.dynamic_slice_in_dim(s.tokens, i, 1, axis=1)  # [B, 1]
            pos = (c.prompt_len + i)[:, None]  # [B, 1]
            mask = jnp.concatenate([c.prompt_mask, jnp.broadcast_to(jnp.arange(n) <= i, (b, n))], axis=1)
            hidden, cache = model(tok, pos, mask, cache=s.cache, cache_index=tp + i)
            h = hidden[:, 0]  # [B, D]
            emb_sum = s.emb_sum
            if cfg.return_embedding:
                emb_sum = emb_sum + jnp.where((i < s.lengths)[:, None], h.astype(jnp.float32), 0.0)
            logits = _last_logits(h, kernel)
            rng, key = jax.random.split(s.rng)
            new = sample_tokens(logits, key, c.temperature, c.top_k, c.top_p)
            s = s.replace(cache=self._constrain_cache(cache), step=i + 1, emb_sum=emb_sum, rng=rng)
            return _record(s, new, logits, c)

        return jax.lax.while_loop(cond, body, state)

    def _score_impl(self, params, tokens, mask):
        self.traces["score"] += 1
        return teacher_forced_logprobs(nnx.merge(self.graphdef, params), tokens, mask, self.config.score_chunk)

    # -------------------------------------------------------------------------- sharding

    def shard_params(self, params: Any) -> Any:
        """Place params on this sampler's mesh by their logical axes (sharding.py rules)."""
        if self.mesh is None:
            return params
        return sharding.shard_params(params, self.mesh)

    def _place(self, tokens, consts: _Consts):
        """Batch arrays over the data axes, everything else replicated (no-op without a mesh).
        `tokens` is [B, Tp], or with shared prefixes the tuple (prefix tokens, prefix mask, row
        prefix, suffix tokens), each batched over its first axis."""
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, tokens), jax.tree.map(jnp.asarray, consts)

        def put(x, batched: bool):
            axes = ("batch",) + (None,) * (x.ndim - 1) if batched else None
            spec = sharding.logical_to_spec(axes, mesh=self.mesh, shape=x.shape)
            return jax.device_put(x, NamedSharding(self.mesh, spec))

        shared = {"stop_tokens", "stop_lens", "eos_ids"}
        consts = consts.replace(
            **{f.name: put(getattr(consts, f.name), f.name not in shared) for f in dataclasses.fields(consts)}
        )
        return jax.tree.map(lambda x: put(x, True), tokens), consts

    def _constrain_cache(self, cache):
        """KV cache leaves [B, KVH, S, Dh] per layer (or [L, B, KVH, S, Dh] stacked): batch over the
        data axes, kv heads over `tensor` (each only where it divides; see sharding.logical_to_spec)."""
        if self.mesh is None:
            return cache

        def constrain(x):
            axes = ("batch", "kv_heads", None, "head_dim")
            if x.ndim == 5:
                axes = ("layers",) + axes
            elif x.ndim != 4:
                return x
            spec = sharding.logical_to_spec(axes, mesh=self.mesh, shape=x.shape)
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

        return jax.tree.map(constrain, cache)


# ------------------------------------------------------------------------------------- score


def teacher_forced_logprobs(
    model: Any, tokens: jax.Array, attention_mask: jax.Array, chunk_size: int = 8192
) -> jax.Array:
    """Traceable core of `score`: logp[:, i] = log p(tokens[:, i] | tokens[:, :i]) -> [B, L] f32.

    0 at i = 0, at padding, and at the first real token of a row (it has no context). Uses
    heads.token_logprobs so the [B, L, V] logits are never materialised.
    """
    mask = attention_mask.astype(jnp.bool_)
    positions = positions_from_mask(mask)
    hidden, _ = model(tokens, positions, mask)
    logp, _ = token_logprobs(hidden[:, :-1], model.unembed_kernel(), tokens[:, 1:], chunk_size)
    logp = jnp.where(mask[:, 1:] & mask[:, :-1], logp, 0.0)  # [B, L-1]
    return jnp.pad(logp, ((0, 0), (1, 0)))


def _score_jit_impl(graphdef, chunk_size, params, tokens, mask):
    return teacher_forced_logprobs(nnx.merge(graphdef, params), tokens, mask, chunk_size)


_score_jit = jax.jit(_score_jit_impl, static_argnums=(0, 1))


def score(graphdef: Any, params: Any, tokens: Any, attention_mask: Any, chunk_size: int = 8192) -> np.ndarray:
    """Teacher-forced per-token log-probs [B, L] f32 (numpy), jitted, shapes padded to powers of two.

    logp[:, i] = log p(tokens[:, i] | tokens[:, :i]); 0 at i = 0 and where there is no context
    (padding, and the first real token of a left-padded row). Inside another jit use
    `teacher_forced_logprobs` instead.
    """
    tokens, mask = _check_score_inputs(tokens, attention_mask)
    b, length = tokens.shape
    tokens, mask = _pad_for_score(tokens, mask, _next_pow2(b), _next_pow2(max(length, 16)), 0)
    return np.asarray(_score_jit(graphdef, int(chunk_size), params, tokens, mask))[:b, :length]


# ------------------------------------------------------------------------------ host helpers


def _check_prompts(prompts: Any) -> int:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        if min(p) < 0:
            raise ValueError(f"prompts[{i}] contains a negative token id {min(p)}")
    return len(prompts)


def _left_pad(prompts, bb: int, tp: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """[bb, tp] int32 tokens and bool mask; bucket-padding rows get one pad token (never empty)."""
    tokens = np.full((bb, tp), pad_id, np.int32)
    mask = np.zeros((bb, tp), bool)
    for i, p in enumerate(prompts):
        tokens[i, tp - len(p) :] = np.asarray(p, np.int32)
        mask[i, tp - len(p) :] = True
    mask[len(prompts) :, -1] = True
    return tokens, mask


def _per_row(value, b: int, bb: int, fill, dtype, name: str) -> np.ndarray:
    a = np.asarray(value, dtype)
    if a.ndim == 0:
        a = np.full((b,), a, dtype)
    if a.shape != (b,):
        raise ValueError(
            f"SamplingParams.{name}: expected a scalar or {b} values (one per prompt), got shape {a.shape}"
        )
    return np.concatenate([a, np.full((bb - b,), fill, dtype)])


def _sampling_arrays(sp: SamplingParams, b: int, bb: int) -> dict[str, np.ndarray]:
    t = _per_row(sp.temperature, b, bb, 0.0, np.float32, "temperature")
    p = _per_row(sp.top_p, b, bb, 1.0, np.float32, "top_p")
    if np.any(np.asarray(sp.top_k) != np.round(np.asarray(sp.top_k))):
        raise ValueError(f"SamplingParams.top_k must be integers, got {sp.top_k}")
    k = _per_row(sp.top_k, b, bb, 0, np.int32, "top_k")
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"SamplingParams.temperature must be finite and >= 0, got {sp.temperature}")
    if np.any(~(p > 0)) or np.any(p > 1):
        raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {sp.top_p}")
    if np.any(k < 0):
        raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {sp.top_k}")
    return {"temperature": t, "top_p": p, "top_k": k}


def _stop_arrays(stops, n_max: int, w: int) -> dict[str, np.ndarray]:
    """Right-aligned padded [n_max, w] stop sequences + lengths (fixed shape: no recompiles)."""
    stops = list(stops or [])
    if len(stops) > n_max:
        raise ValueError(f"{len(stops)} stop sequences given, SamplerConfig.max_stop_sequences is {n_max}")
    toks = np.full((n_max, w), -1, np.int32)
    lens = np.zeros((n_max,), np.int32)
    for i, s in enumerate(stops):
        s = list(s)
        if not 1 <= len(s) <= w:
            raise ValueError(f"stop_sequences[{i}] has length {len(s)}; must be 1..{w} (SamplerConfig.max_stop_len)")
        if min(s) < 0:
            raise ValueError(f"stop_sequences[{i}] contains a negative token id")
        toks[i, w - len(s) :] = s
        lens[i] = len(s)
    return {"stop_tokens": toks, "stop_lens": lens}


def _check_score_inputs(tokens, attention_mask) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.asarray(tokens)
    mask = np.asarray(attention_mask)
    if tokens.ndim != 2 or mask.shape != tokens.shape:
        raise ValueError(f"score: tokens and attention_mask must both be [B, L]; got {tokens.shape} and {mask.shape}")
    if tokens.dtype.kind not in "iu":
        raise ValueError(f"score: tokens must be integer ids, got dtype {tokens.dtype}")
    return tokens.astype(np.int32), mask.astype(bool)


def _pad_for_score(tokens, mask, bb: int, lb: int, pad_id: int):
    """Right-pad the length (causal: real tokens never see it) and add bucket rows of one token."""
    b, length = tokens.shape
    t = np.full((bb, lb), pad_id, np.int32)
    m = np.zeros((bb, lb), bool)
    t[:b, :length], m[:b, :length] = tokens, mask
    m[b:, 0] = True
    return t, m


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _weak(x):
    """A weak reference to a params leaf (jax arrays allow them), or a callable that returns x."""
    try:
        return weakref.ref(x)
    except TypeError:
        return lambda: x


def _dtype(name):
    return None if name is None else jnp.dtype(name)
