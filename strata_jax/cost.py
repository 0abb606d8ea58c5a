"""The work a run's model calls did, counted from the padded shapes they ran, and a roofline model of
what that work would take on a named accelerator at a named model's size.

Why: StraTA's iteration overhead over GRPO (the goal: under 5%) is a question about a 7B model on
GPUs, and this project's CPU hosts answer it badly on two counts. Their timings swing by more than
the effect (2.5x run to run, docs/BENCHMARKS.md), and the tiny model's cost is attention-bound,
where a 7B model's is in its matmuls. The counts here are exact: every prefill, decode step,
scoring pass and update step adds the token slots, attention pairs and decode steps that its
padded shapes ran. `seconds` turns them into a modelled time for any model config and hardware,
under stated efficiencies. It is a model, not a measurement: docs/BENCHMARKS.md quotes it as one.

Counted per call:
  tokens       token slots through the layer stack (padding included: it runs)
  pairs        attention (query, key) pairs as the kernels compute them, dense: every query slot
               of a call against every key slot it is given (causal masking is not skipped)
  head_tokens  positions through the vocabulary head (the prefill's last position, the scoring's
               and the update's logprob window)
  decode       one (rows, steps, cache_slots) per sampler decode: `steps` sequential forward steps
               of `rows` padded rows, each reading a cache of `cache_slots` slots
  real_tokens, real_pairs
               the same passes' rows run alone: their real tokens and their lengths squared (no
               padding, no shared prefixes), for comparison with a padding-free update

The roofline (`seconds`): prefill, scoring and update are compute-bound, FLOPs over (devices x peak
x mfu), times 3 for the update (forward and backward). A decode step is bounded by the larger of
reading the weights and its rows' KV cache (per device, at hbm_share of the HBM bandwidth) and its
rows' FLOPs; the rows are split over the devices (data parallel, the weights on each).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from strata_jax.models.config import ModelConfig


@dataclasses.dataclass
class Work:
    """Model work counted so far (module docstring). Counters only grow; `since` takes a span."""

    tokens: float = 0.0
    pairs: float = 0.0
    head_tokens: float = 0.0
    decode: list = dataclasses.field(default_factory=list)  # [(rows, steps, cache_slots)]
    # The same passes' real tokens and pairs (each row alone, no padding, no shared prefix): what
    # a padding-free update (verl's remove-padding) would run.
    real_tokens: float = 0.0
    real_pairs: float = 0.0

    def add(
        self,
        tokens: float = 0.0,
        pairs: float = 0.0,
        head_tokens: float = 0.0,
        real_tokens: float = 0.0,
        real_pairs: float = 0.0,
    ) -> None:
        self.tokens += float(tokens)
        self.pairs += float(pairs)
        self.head_tokens += float(head_tokens)
        self.real_tokens += float(real_tokens)
        self.real_pairs += float(real_pairs)

    def add_decode(self, rows: int, steps: int, cache_slots: int) -> None:
        if steps > 0:
            self.decode.append((int(rows), int(steps), int(cache_slots)))

    def snapshot(self) -> Work:
        return dataclasses.replace(self, decode=list(self.decode))

    def since(self, earlier: Work) -> Work:
        """The work added after `earlier` (a snapshot of this counter)."""
        return Work(
            **{k: getattr(self, k) - getattr(earlier, k) for k in _TOTALS}, decode=self.decode[len(earlier.decode) :]
        )

    def __add__(self, other: Work) -> Work:
        return Work(**{k: getattr(self, k) + getattr(other, k) for k in _TOTALS}, decode=self.decode + other.decode)

    def times(self, k: int) -> Work:
        """The same calls with k times the rows each: every pass's tokens, pairs and head positions
        and every decode's rows times k, its steps and cache unchanged. An iteration of k times the
        tasks (each call batches every environment) does about this work: tasks are independent
        draws, so its rows are like these rows k times over (padding and shared prefixes aside)."""
        return Work(
            **{f: getattr(self, f) * k for f in _TOTALS},
            decode=[(rows * k, steps, cache) for rows, steps, cache in self.decode],
        )

    @property
    def decode_steps(self) -> int:
        return sum(s for _, s, _ in self.decode)


_TOTALS = ("tokens", "pairs", "head_tokens", "real_tokens", "real_pairs")


def real(lengths) -> dict:
    """Each row run alone: its own tokens, and its own length squared attention pairs."""
    n = np.asarray(lengths, np.float64)
    return {"real_tokens": float(n.sum()), "real_pairs": float((n * n).sum())}


def dense(rows: int, length: int, head: int) -> dict:
    """One pass over [rows, length] left-padded rows, `head` positions per row through the head."""
    return {"tokens": rows * length, "pairs": rows * length * length, "head_tokens": rows * min(head, length)}


def prefixed(prefix_rows: int, tpre: int, rows: int, ts: int, head: int) -> dict:
    """Prefixes [prefix_rows, Tpre] run once, then [rows, Ts] suffixes that attend to their prefix
    and themselves; `head` positions of each suffix row through the head."""
    return {
        "tokens": prefix_rows * tpre + rows * ts,
        "pairs": prefix_rows * tpre * tpre + rows * ts * (tpre + ts),
        "head_tokens": rows * min(head, ts),
    }


def plan_cost(work: dict, pair: float) -> float:
    """What a packing plan weighs: its padded token slots plus `pair` (packing.pair_cost: one
    attention pair's FLOPs over one token's) x its dense attention pairs."""
    return work["tokens"] + pair * work["pairs"]


def batch_work(batch, window: int) -> dict:
    """The pass `train.sequence_logprobs` / `shared_batch_logprobs` / `tree_logprobs` runs over a
    TokenBatch [S, L], a SharedBatch (prefixes once, then the rows' suffixes), a TreeBatch or a
    TreeRows, with a logprob window of `window` columns through the head."""
    batch = getattr(batch, "tree", batch)  # a TreeRows runs its TreeBatch
    if hasattr(batch, "end"):  # a TreeBatch (strata_jax/tree.py): packed rows, the head on the gathered windows
        out = dense(*batch.tokens.shape, 0)
        out["head_tokens"] = batch.slots.shape[0] * min(window, batch.slots.shape[1] - 1)
        return out
    prefix = getattr(batch, "prefix_tokens", None)
    if prefix is None:
        s, length = batch.tokens.shape
        return dense(s, length, window)
    upre, tpre = prefix.shape
    s, ls = batch.rows.tokens.shape
    return prefixed(upre, tpre, s, ls, window)


# --------------------------------------------------------------------------------- the roofline


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s of one device
    hbm_bytes_per_s: float  # one device
    devices: int = 8
    mfu: float = 0.4  # achieved share of peak in compute-bound passes (the stated goal)
    hbm_share: float = 0.6  # achieved share of HBM bandwidth in decode (the stated goal)
    bytes_per_param: int = 2  # bf16 weights and KV cache


H200 = Hardware("8 x H200", peak_flops=989e12, hbm_bytes_per_s=4.8e12)


def _qwen2(vocab, d, f, layers, heads, kv, tied):
    return ModelConfig(
        arch="qwen2",
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=f,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=d // heads,
        qkv_bias=True,
        rope_theta=1e6,
        tie_word_embeddings=tied,
        dtype="bfloat16",
        param_dtype="bfloat16",
    )


# The published shapes of the models the papers train (their config.json), for `seconds`, and of
# the smallest one, which the GPU benches (bench/sampler.py, bench/train.py --gpu) also build.
MODELS = {
    "qwen2.5-0.5b": _qwen2(151936, 896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": _qwen2(151936, 1536, 8960, 28, 12, 2, True),
    "qwen2.5-7b": _qwen2(152064, 3584, 18944, 28, 28, 4, False),
}


def layer_flops(m: ModelConfig) -> float:
    """FLOPs of one token through all layers' projections and MLPs (2 per multiply-add)."""
    d, f = m.hidden_size, m.intermediate_size
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return 2.0 * m.num_layers * (d * (q + 2 * kv) + q * d + 3 * d * f)


def pair_flops(m: ModelConfig) -> float:
    """FLOPs of one (query, key) pair in all layers: q.k and p.v."""
    return 4.0 * m.num_layers * m.num_heads * m.head_dim


def head_flops(m: ModelConfig) -> float:
    return 2.0 * m.hidden_size * m.vocab_size


def weight_bytes(m: ModelConfig, hw: Hardware) -> float:
    """The weights a decode step reads: every layer's matrices and the vocabulary head."""
    return (layer_flops(m) / 2.0 + m.hidden_size * m.vocab_size) * hw.bytes_per_param


def kv_bytes_per_slot(m: ModelConfig, hw: Hardware) -> float:
    return 2.0 * m.num_layers * m.num_kv_heads * m.head_dim * hw.bytes_per_param


def seconds(work: Work, m: ModelConfig, hw: Hardware, train: bool = False, real: bool = False) -> float:
    """Modelled seconds of `work` at model `m` on `hw` (module docstring); `train`: forward and
    backward (3x a forward's FLOPs); `real`: the passes on their real tokens only (no padding, no
    shared prefixes), the decode as it ran."""
    tokens, pairs = (work.real_tokens, work.real_pairs) if real else (work.tokens, work.pairs)
    flops = tokens * layer_flops(m) + pairs * pair_flops(m) + work.head_tokens * head_flops(m)
    total = (3.0 if train else 1.0) * flops / (hw.devices * hw.peak_flops * hw.mfu)
    w, kvb = weight_bytes(m, hw), kv_bytes_per_slot(m, hw)
    per_token = layer_flops(m) + head_flops(m)
    for rows, steps, cache in work.decode:
        r = math.ceil(rows / hw.devices)  # rows per device
        read = (w + r * cache * kvb) / (hw.hbm_bytes_per_s * hw.hbm_share)
        compute = r * (per_token + cache * pair_flops(m)) / (hw.peak_flops * hw.mfu)
        total += steps * max(read, compute)
    return total
