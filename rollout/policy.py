"""The policy interface the rollout loop calls, chat rendering, and a scripted policy for tests.

A policy turns a batch of chat prompts into generations in ONE call (the JAX sampler batches
them on the accelerator). `kind` tells the policy which token budget / stop rule applies:
"strategy", "action" or "judge". `keys` identify each prompt's LLM call in the iteration
(strategy (p, k), revision (p, n, m, r) of kind "strategy", action (p, n, m, t), judge (p, n, m), or
(p, n, m, j) with several judge samples); a sampler may ignore them or use them to
derive per-row RNG streams, a scripted policy uses them to script each trajectory.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

KINDS = ("strategy", "action", "judge")
FINISH_REASONS = ("eos", "stop", "length")

Messages = list[dict[str, str]]


@dataclass
class Generation:
    """One sampled response. Arrays are host numpy.

    `logprobs[i]` is the sampling policy's log-prob of `response_ids[i]` given the prompt and the
    earlier response tokens; `embedding` is the mean final hidden state over the response tokens
    (strategy diversity), None when the policy does not compute it.
    """

    text: str
    prompt_ids: np.ndarray  # [Lp] int32
    response_ids: np.ndarray  # [Lr] int32
    logprobs: np.ndarray  # [Lr] f32
    embedding: np.ndarray | None  # [D] f32
    finish_reason: str  # one of FINISH_REASONS

    def check(self) -> Generation:
        """Raise ValueError when the arrays disagree (a sampler bug must not misalign the loss)."""
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(f"Generation: {len(self.logprobs)} logprobs for {len(self.response_ids)} response tokens")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Generation.finish_reason={self.finish_reason!r}; expected one of {FINISH_REASONS}")
        return self


class Policy(Protocol):
    def generate(self, prompts: list[Messages], kind: str, keys: Sequence[Hashable] | None = None) -> list[Generation]:
        """One Generation per prompt, in order."""
        ...


def render(messages: Messages, tokenizer: Any) -> str:
    """Chat messages -> the prompt string, via the tokenizer's own chat template.

    A tokenizer without a chat template raises (transformers' error): a silently invented format
    would train the model on a prompt layout it never sees elsewhere.
    """
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"policy kind {kind!r}; expected one of {KINDS}")


# --- scripted policy (tests, benchmarks) ----------------------------------------------------------


@dataclass
class Reply:
    """A scripted answer with optional overrides of the fake statistics."""

    text: str
    mean_logprob: float | None = None  # every response token gets this log-prob
    embedding: Sequence[float] | None = None
    finish_reason: str = "stop"


def fake_token_ids(text: str, vocab: int = 32000) -> np.ndarray:
    """Whitespace 'tokenizer': one id in [1, vocab) per word (crc32), 0 is reserved for padding."""
    return np.fromiter(
        (zlib.crc32(w.encode("utf-8", "surrogatepass")) % (vocab - 1) + 1 for w in text.split()), dtype=np.int32
    )


def fake_logprob(ids: np.ndarray) -> np.ndarray:
    """Deterministic per-token log-prob of a token id, distinct across nearby ids, in [-1.3, -0.1].

    A test can recompute it from `tokens[s, i]` to check that old_logp is aligned with tokens.
    """
    return (-((np.asarray(ids, np.int64) % 13) + 1) / 10.0).astype(np.float32)


def fake_embedding(text: str, dim: int = 8) -> np.ndarray:
    """A deterministic unit vector per text (seeded by blake2b, not Python's salted hash)."""
    seed = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
    v = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    return v / np.linalg.norm(v)


def messages_text(messages: Messages) -> str:
    """What the fake tokenizer sees for a prompt: role-tagged contents, one after the other."""
    return "\n".join(f"<{m['role']}> {m['content']}" for m in messages)


class ScriptedPolicy:
    """A policy driven by `script(messages, kind, key) -> str | Reply`.

    `key` is the call's key from the rollout loop (see module doc), or the prompt's position in
    the batch when the caller passes no keys. Token ids come from `fake_token_ids`, log-probs
    from `fake_logprob` (unless a Reply overrides them), embeddings from `fake_embedding` of the
    text. `calls` records (kind, batch size) per generate call.
    """

    def __init__(self, script: Callable[[Messages, str, Hashable], Any], vocab: int = 32000, embed_dim: int = 8):
        self.script = script
        self.vocab = vocab
        self.embed_dim = embed_dim
        self.calls: list[tuple[str, int]] = []
        self._words: dict[int, str] = {}  # fake id -> word, for decode

    def decode(self, ids) -> str:
        """Fake ids back to their words, space-joined (ids this policy produced)."""
        return " ".join(self._words[int(i)] for i in ids)

    def generate(self, prompts: list[Messages], kind: str, keys: Sequence[Hashable] | None = None) -> list[Generation]:
        check_kind(kind)
        keys = list(range(len(prompts))) if keys is None else list(keys)
        if len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} keys for {len(prompts)} prompts")
        self.calls.append((kind, len(prompts)))
        return [self._one(msgs, kind, key) for msgs, key in zip(prompts, keys)]

    def _one(self, messages: Messages, kind: str, key: Hashable) -> Generation:
        out = self.script(messages, kind, key)
        reply = out if isinstance(out, Reply) else Reply(str(out))
        response = fake_token_ids(reply.text, self.vocab)
        self._words.update(zip(response.tolist(), reply.text.split()))
        if reply.mean_logprob is None:
            logp = fake_logprob(response)
        else:
            logp = np.full(len(response), reply.mean_logprob, np.float32)
        if reply.embedding is not None:
            emb = np.asarray(reply.embedding, np.float32)
        else:  # like the sampler: embeddings only for strategies, where diversity needs them
            emb = fake_embedding(reply.text, self.embed_dim) if kind == "strategy" else None
        return Generation(
            text=reply.text,
            prompt_ids=fake_token_ids(messages_text(messages), self.vocab),
            response_ids=response,
            logprobs=logp,
            embedding=emb,
            finish_reason=reply.finish_reason,
        ).check()
