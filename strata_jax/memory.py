"""Will it fit? The memory of SFT, the scoring and the update, estimated before any work.

A run that does not fit is killed by the kernel without a message (no swap on small machines), or
dies in an out-of-memory error minutes in, after the model was loaded and the SFT demonstrations
built. `estimate` gives the arithmetic first, per device, in bytes:

- weights (param dtype), their gradients and AdamW's two moments (param dtype) when training;
- a second copy of the weights: the reference policy's when the KL term needs it, or with LoRA the
  merged weights the sampler decodes (the reference is then the base itself, adapters off);
- activations kept for the backward pass: every layer's tensors per token without remat, only
  each layer's input with remat (plus one layer's full set, recomputed in the backward). Remat
  counts only with `scan_layers`: on XLA:CPU the unrolled layers' checkpoints save almost nothing
  (SmolLM2-135M at 4 x 512 tokens: 6.19 GB of temporaries with remat, 6.54 GB without; scanned,
  0.98 GB), so `plan` turns both on together;
- the vocabulary head: [rows, window, chunk] float32 logits and their gradient
  (strata_jax/models/heads.py runs it in vocabulary chunks). The einsum attention's
  [rows, heads, T, T] scores are counted per token with the activations (none with the fused
  kernels, which never materialise them).

`plan` picks remat where the run needs it, or refuses with the arithmetic (`DoesNotFitError`).
The per-token activation count is calibrated on XLA:CPU against measured peaks (SmolLM2-135M,
docs/BENCHMARKS.md "Memory"); it over-counts fused elementwise work on a GPU, so it errs safe.
"""

from __future__ import annotations

import dataclasses
import os

from strata_jax.models.config import ModelConfig

GIB = 1 << 30
# The process itself (the jax runtime, compiled programs, Python, the tokenizer, environments) and
# XLA's scratch buffers, measured: a 2-layer tiny model's SFT peaks at 0.9 GB resident.
OVERHEAD_BYTES = 1 * GIB
# Share of the available memory a plan may fill: XLA's buffers fragment and the host keeps other
# work (environment pools, the page cache of the checkpoint being written).
HEADROOM = 0.85


class DoesNotFitError(MemoryError):
    """The run's estimated memory exceeds what the device (or host) has; the message gives the sum."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes per device of one phase; `total` includes the process overhead."""

    what: str
    weights: int
    grads: int
    optimizer: int
    reference: int
    activations: int
    head: int

    @property
    def total(self) -> int:
        return (
            self.weights + self.grads + self.optimizer + self.reference + self.activations + self.head + OVERHEAD_BYTES
        )

    def breakdown(self) -> str:
        parts = [
            ("weights", self.weights),
            ("gradients", self.grads),
            ("AdamW moments", self.optimizer),
            ("second weight copy", self.reference),
            ("activations", self.activations),
            ("vocabulary head", self.head),
            ("process overhead", OVERHEAD_BYTES),
        ]
        return " + ".join(f"{name} {b / GIB:.2f}" for name, b in parts if b) + f" = {self.total / GIB:.2f} GiB"


def num_params(m: ModelConfig) -> int:
    d, f, h, k, dh = m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim
    attn = d * h * dh * 2 + d * k * dh * 2 + (h * dh + 2 * k * dh if m.qkv_bias else 0) + (d if m.o_bias else 0)
    mlp = 3 * d * f + (2 * f + d if m.mlp_bias else 0)
    layer = attn + mlp + 2 * d
    head = 0 if m.tie_word_embeddings else d * m.vocab_size
    return m.vocab_size * d + m.num_layers * layer + d + head


def num_lora_params(m: ModelConfig) -> int:
    """Adapter weights: rank x (fan-in + fan-out) per targeted projection and layer."""
    d, f, h, k, dh = m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim
    fans = {
        "q": (d, h * dh),
        "k": (d, k * dh),
        "v": (d, k * dh),
        "o": (h * dh, d),
        "gate": (d, f),
        "up": (d, f),
        "down": (f, d),
    }
    return m.num_layers * m.lora_rank * sum(sum(fans[t]) for t in m.lora_targets) if m.lora_rank else 0


def layer_floats_per_token(m: ModelConfig, length: int, attention: str) -> int:
    """Values one layer keeps per token for its backward without remat: the two norms' inputs and
    outputs, q / k / v before and after RoPE, the attention output and its projection, the MLP's
    gate, up, activation and product; with the einsum attention also three [T] rows per head
    (scores, mask and probabilities: the [B, H, T, T] tensors counted per token; fitted to
    XLA:CPU's buffers at 4 x 512 and 8 x 768 tokens within 5%)."""
    d, f, h, k, dh = m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim
    own = 6 * d + 4 * f + 3 * h * dh + 3 * k * dh
    return own + (3 * h * length if attention == "einsum" else 0)


def estimate(
    m: ModelConfig,
    what: str,
    rows: int,
    length: int,
    *,
    train: bool,
    remat: bool,
    window: int | None = None,
    chunk: int = 8192,
    reference: bool = False,
    devices: int = 1,
) -> Estimate:
    """Bytes per device of one forward (train=False: scoring) or one forward + backward + AdamW
    step (train=True) over `rows` rows of `length` tokens, of which the last `window` reach the
    vocabulary head. Weights, gradients and moments are split over `devices` (FSDP). With LoRA
    (m.lora_rank > 0) gradients and moments are the adapters' and no reference copy is kept; the
    activations are the same (the backward still runs through every layer)."""
    p, lora = num_params(m), num_lora_params(m)
    pb = m.params_dtype.itemsize
    cb = m.compute_dtype.itemsize
    window = length if window is None else min(window, length)
    tokens = rows * length
    weights = (p + lora) * pb // devices
    trained = (lora if lora else p) * pb // devices  # with LoRA only the adapters train
    grads = trained if train else 0
    optimizer = 2 * trained if train else 0
    # A second copy of the weights: the reference policy's, or with LoRA (whose reference is the
    # base itself) the merged weights the sampler decodes.
    ref = weights if reference or lora else 0
    per_layer = layer_floats_per_token(m, length, m.attention)
    if not train:  # inference keeps one layer's tensors at a time
        acts = tokens * per_layer * cb
    elif remat:  # each layer's input, plus one layer recomputed in the backward
        acts = tokens * (m.num_layers * m.hidden_size + per_layer) * cb
    else:
        acts = tokens * m.num_layers * per_layer * cb
    width = min(chunk, m.vocab_size)
    head = rows * window * width * 4 * (3 if train else 1)  # logits, probabilities, their gradient
    return Estimate(what, weights, grads, optimizer, ref, int(acts), int(head))


def available_bytes(devices=None) -> tuple[int, str]:
    """(bytes, what) a plan may use per device: the accelerator's memory limit, or on the CPU the
    host's physical memory (its devices share it, so it is divided among them)."""
    import jax

    devices = list(devices if devices is not None else jax.local_devices())
    stats = [d.memory_stats() if hasattr(d, "memory_stats") else None for d in devices]
    if all(s and s.get("bytes_limit") for s in stats):
        return int(min(s["bytes_limit"] for s in stats)), f"{devices[0].device_kind} ({len(devices)} devices)"
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(phys // max(len(devices), 1)), f"host memory ({phys / GIB:.1f} GiB over {len(devices)} devices)"


def plan(
    m: ModelConfig, what: str, rows: int, length: int, *, train: bool, remat: bool, available: int, where: str, **kw
) -> tuple[bool, Estimate]:
    """(remat, estimate) for the phase: as configured if it fits, with remat turned on if only that
    fits, else DoesNotFitError naming every term of the sum and what would shrink it. `remat`
    means remat over scanned layers (the only kind that saves memory, see the module doc)."""
    est = estimate(m, what, rows, length, train=train, remat=remat, **kw)
    budget = int(available * HEADROOM)
    if est.total <= budget:
        return remat, est
    if train and not remat:
        with_remat = estimate(m, what, rows, length, train=train, remat=True, **kw)
        if with_remat.total <= budget:
            return True, with_remat
        est = with_remat
    raise DoesNotFitError(
        f"{what} at {rows} rows x {length} tokens cannot fit in {where}: {est.breakdown()}"
        f"{' (with remat)' if train else ''}, over {HEADROOM:.0%} of {available / GIB:.1f} GiB; "
        "use fewer rows a step (sft.batch_rows, train.micro_batches), shorter buckets, or bfloat16"
    )
