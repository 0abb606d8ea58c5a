"""The policy the rollout loop calls, backed by the jitted JAX sampler.

One `Sampler` per call kind (strategy / action / judge): each has its own token budget (static,
part of the compiled program) and stop tags (traced). Prompts are chat messages rendered with the
tokenizer's own chat template. Randomness is a pure function of (iteration key, call counter), so
a resumed run draws the same samples as an uninterrupted one.

With `prefix_cache_tokens` > 0 the action sampler keeps each prompt's head across calls
(strata_jax/sampling.py, "Prefix cache across calls"): every action call of a rollout carries all
running trajectories, and each step prompt repeats its trajectory's head. The strategy and judge
calls come once per episode (and per revision) with prompts of their own, so they would only fill
a pool. Setting `params` clears the cache.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np

from rollout.policy import FINISH_REASONS, Generation, Messages, check_kind, render
from strata_jax.sampling import Sampler, SamplerConfig, SamplingParams

# The closing tag that ends each kind's answer (rollout/prompts.py asks for these formats).
STOP_TAGS = {"strategy": "</strategy>", "action": "</action>", "judge": "</bad_steps>"}


def stop_sequences(tokenizer: Any, tag: str) -> list[list[int]]:
    """Token ids of `tag` as it can appear after text: alone, after a space, and merged with the
    text before it. A BPE vocabulary can hold a token that ends with the start of the tag, such as
    "]</" in `search[a b]</action>`, which the shop tokenizer writes "]</" "action" ">". Every such
    token is followed by the rest of the tag as the tokenizer writes it; a variant is kept only
    if the tokenizer reproduces that token when it encodes the text."""
    seqs = []
    for variant in (tag, " " + tag):
        ids = tokenizer.encode(variant, add_special_tokens=False)
        if ids and ids not in seqs:
            seqs.append(ids)
    # Raw token strings keep ASCII as is (byte-level BPE, SentencePiece), so only tokens whose raw
    # string holds the tag's first character need decoding.
    candidates = sorted(i for t, i in tokenizer.get_vocab().items() if tag[0] in t)
    for tid in candidates:
        text = tokenizer.decode([tid])
        for k in range(1, len(tag)):
            if len(text) > k and text.endswith(tag[:k]):
                ids = tokenizer.encode(text + tag[k:], add_special_tokens=False)
                if ids and ids[0] == tid and ids not in seqs:
                    seqs.append(ids)
    return seqs


def eos_ids(tokenizer: Any) -> tuple[int, ...]:
    """The chat end-of-turn and end-of-text ids the tokenizer knows."""
    ids = set()
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>"):
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id:
            ids.add(i)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("tokenizer has no end-of-turn / eos token: generation could never stop on EOS")
    return tuple(sorted(ids))


class JaxPolicy:
    """`Policy` over the JAX sampler. `params` is swapped in by the trainer after each update."""

    def __init__(
        self,
        graphdef: Any,
        params: Any,
        tokenizer: Any,
        budgets: dict[str, int],
        *,
        prompt_buckets: Sequence[int],
        batch_buckets: Sequence[int],
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        mesh=None,
        cache_dtype: str | None = None,
        shared_prefix: bool = False,
        fuse_decode: bool = True,
        prefix_cache_tokens: int = 0,
        prefix_cache_bytes: int = 512 << 20,
        seed: int = 0,
    ):
        self.tokenizer = tokenizer
        self.sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        self.kind_sampling: dict[str, SamplingParams] = {}  # per call kind, overriding `sampling`
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        eos = eos_ids(tokenizer)
        self.samplers = {}
        self.stops = {k: stop_sequences(tokenizer, STOP_TAGS[k]) for k in budgets}
        for kind, budget in budgets.items():
            check_kind(kind)
            stops = self.stops[kind]
            cfg = SamplerConfig(
                max_stop_sequences=max(8, len(stops)),
                max_stop_len=max([16, *map(len, stops)]),
                max_new_tokens=int(budget),
                max_prompt_len=int(max(prompt_buckets)),
                prompt_buckets=tuple(prompt_buckets),
                max_batch=int(max(batch_buckets)),
                batch_buckets=tuple(batch_buckets),
                eos_ids=eos,
                pad_id=int(pad),
                cache_dtype=cache_dtype,
                return_embedding=(kind == "strategy"),
                shared_prefix=shared_prefix,
                fuse_decode=bool(fuse_decode),
                prefix_cache_tokens=int(prefix_cache_tokens) if kind == "action" else 0,
                prefix_cache_bytes=int(prefix_cache_bytes),
            )
            self.samplers[kind] = Sampler(graphdef, cfg, mesh=mesh)
        self.params = params
        self.tokens_generated = 0
        self.sample_seconds = 0.0
        self.seconds_by_kind = {k: 0.0 for k in self.samplers}  # sampler time per call kind
        self.reseed(seed)

    def reseed(self, seed: int, iteration: int = 0, shard: int | None = None) -> None:
        """Randomness for one iteration: a pure function of (seed, iteration, call number), and of
        the rollout shard when the iteration is collected in several (rollout/shards.py). The
        sampler draws one key per call for the whole batch, so a shard's samples depend on its own
        calls only, whichever process runs it; shard=None is the one-shard key."""
        self._key = jax.random.fold_in(jax.random.key(seed), iteration)
        if shard is not None:
            self._key = jax.random.fold_in(self._key, int(shard))
        self._calls = 0

    @property
    def params(self) -> Any:
        return self._params

    @params.setter
    def params(self, params: Any) -> None:
        """New weights: cached prompt heads were computed with the old ones (the samplers would
        notice too, by the arrays' identity; clearing here frees the bookkeeping at once)."""
        self._params = params
        for s in self.samplers.values():
            s.clear_prefix_cache()

    @property
    def num_compiles(self) -> int:
        return sum(s.num_compiles for s in self.samplers.values())

    def decode(self, ids) -> str:
        """Response ids -> text, as `generate` decodes them (collect maps the action's tokens with it)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode_prompt(self, messages: Messages) -> list[int]:
        return self.tokenizer.encode(render(messages, self.tokenizer), add_special_tokens=False)

    def generate(self, prompts: list[Messages], kind: str, keys: Sequence[Hashable] | None = None) -> list[Generation]:
        import time

        check_kind(kind)
        if kind not in self.samplers:
            raise ValueError(f"JaxPolicy has no sampler for kind {kind!r} (budgets: {sorted(self.samplers)})")
        if not prompts:
            return []
        sampler = self.samplers[kind]
        ids = [self.encode_prompt(m) for m in prompts]
        limit = max(sampler.prompt_buckets)
        too_long = [i for i, p in enumerate(ids) if len(p) > limit]
        if too_long:
            raise ValueError(
                f"{kind} prompt {too_long[0]} has {len(ids[too_long[0]])} tokens, more than the "
                f"largest prompt bucket {limit}: raise sampling.prompt_buckets"
            )
        key = jax.random.fold_in(self._key, self._calls)
        self._calls += 1
        t0 = time.perf_counter()
        out = sampler.generate(
            self.params, ids, self.kind_sampling.get(kind, self.sampling), key, stop_sequences=self.stops[kind]
        )
        dt = time.perf_counter() - t0
        self.sample_seconds += dt
        self.seconds_by_kind[kind] += dt
        self.tokens_generated += int(out.lengths.sum())
        gens = []
        for i, prompt_ids in enumerate(ids):
            n = int(out.lengths[i])
            resp = out.tokens[i, :n].astype(np.int32)
            gens.append(
                Generation(
                    text=self.tokenizer.decode(resp, skip_special_tokens=True),
                    prompt_ids=np.asarray(prompt_ids, np.int32),
                    response_ids=resp,
                    logprobs=out.logprobs[i, :n].astype(np.float32),
                    embedding=None if out.embedding is None else out.embedding[i],
                    finish_reason=FINISH_REASONS[int(out.finish_reason[i])],
                ).check()
            )
        return gens
