"""`Run`: everything one training or evaluation of a workdir holds: the mesh, the model and its
reference copy, the sampling policy, the train state with its optimiser and update step, and the
checkpoints it resumes from.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from rollout.jax_policy import JaxPolicy
from rollout.scoring import logprob_window
from rollout.setup import advantage_params, fitted_settings, loss_dict, make_mesh, model_settings, rollout_shards
from rollout.shards import process_shards
from rollout.warmstart import model_dir
from strata_jax import lora, sharding
from strata_jax.checkpoint import Checkpointer
from strata_jax.cost import Work
from strata_jax.memory import DoesNotFitError
from strata_jax.models.hf import load_hf_model, load_tokenizer
from strata_jax.models.qwen2 import Decoder
from strata_jax.train import (
    abstract_train_state,
    init_train_state,
    loss_config,
    make_optimizer,
    make_train_step,
    optimizer_config,
    uses_reference,
)


class Run:
    """Model, policy, update and checkpoints of one workdir."""

    def __init__(self, config, workdir: pathlib.Path, for_training: bool = True):
        self.config, self.workdir = config, pathlib.Path(workdir)
        self.mesh = make_mesh(config)  # first: jax.distributed must start before devices are touched
        self.nproc, self.rank = jax.process_count(), jax.process_index()
        self.lead = self.rank == 0  # the one process that writes run files (metrics, plots, batches)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.lead:
            (self.workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
        self.shards = rollout_shards(config)
        self.my_shards = process_shards(self.shards, self.rank, self.nproc)
        # Each process samples on its own devices with a local copy of the params, so a rollout
        # never waits on another host (docs/TPU.md); one process samples on the global mesh.
        self.local_mesh = self.mesh if self.nproc == 1 else sharding.local_mesh(int(config.mesh.tensor))
        self.model_path = model_dir(config, self.workdir, self.mesh)
        t = config.train
        # The update's memory, checked before the model is loaded (strata_jax/memory.py). An
        # evaluation or export plans the same way: remat over scanned layers, when the plan turns
        # it on, also changes the layout of the checkpoints it restores.
        try:
            settings, self.memory = fitted_settings(
                config,
                self.model_path,
                "the update",
                int(t.mini_batch_rows) // int(t.micro_batches),
                max(t.length_buckets),
                window=logprob_window(config),
                reference=uses_reference(t),
                devices=self.mesh.size,
            )
        except DoesNotFitError:
            if for_training:
                raise
            settings, self.memory = model_settings(config), None  # no update will run: nothing was saved by one
        if for_training:  # the scoring: a forward over mini_batch_rows rows per device, no remat to help it
            fitted_settings(
                config,
                self.model_path,
                "the scoring",
                int(t.mini_batch_rows),
                max(t.length_buckets),
                train=False,
                window=logprob_window(config),
                reference=uses_reference(t),
                devices=self.mesh.size,
            )
        (graphdef, params), self.mcfg = load_hf_model(
            self.model_path, mesh=self.mesh, split=True, lora_seed=int(config.seed), **settings
        )
        self.graphdef = graphdef
        # With LoRA the train state holds the adapters and the frozen base apart (TrainState.frozen),
        # and the sampler decodes the decoder built without adapters, on merged weights.
        self.lora = self.mcfg.lora_rank > 0
        frozen, self.decode_graphdef = None, graphdef
        if self.lora:
            params, frozen = lora.split(params)
            plain = dataclasses.replace(self.mcfg, lora_rank=0)
            self.decode_graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(plain, rngs=nnx.Rngs(0))))
            self._merge = jax.jit(functools.partial(lora.merged_params, cfg=self.mcfg))
        # The model whose costs the scoring's and the update's packing plans weigh (attention pairs
        # against tokens, packing.pair_cost): this run's own; bench/iteration.py plans as the model
        # it models.
        self.plan_model = self.mcfg
        self.tokenizer = load_tokenizer(self.model_path)
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        # The reference policy is the starting model; params are donated by the update, so copy.
        # Without a KL term (train.kl_coef = 0) nothing reads it: no copy, no scoring pass. With
        # LoRA it is the frozen base with the adapters off (`reference_params`): no copy either.
        self.ref_params = jax.tree.map(jnp.copy, params) if uses_reference(t) and not self.lora else None
        ocfg = optimizer_config(
            {
                "lr": t.lr,
                "weight_decay": t.weight_decay,
                "grad_clip": t.grad_clip,
                "schedule": t.schedule,
                "warmup_steps": t.warmup_steps,
            }
        )
        self.optimizer = make_optimizer(ocfg, total_steps=None)
        self.state = init_train_state(graphdef, params, self.optimizer, int(config.seed), self.mesh, frozen=frozen)
        self.ckpt = Checkpointer(
            self.workdir / "checkpoints",
            save_every=1,
            keep=int(config.checkpoint.keep),
            async_save=bool(config.checkpoint.async_save),
        )
        self.start_iteration = 1
        restored = self.ckpt.restore_latest(abstract_train_state(self.state.params, self.optimizer, self.mesh))
        if restored is not None:
            state, extra = restored
            self.state = state.replace(frozen=self.state.frozen)  # the base is the model's, not the checkpoint's
            self.start_iteration = int(extra["iteration"]) + 1
        self._synced = None
        self.policy = self.new_policy(self._policy_params())
        self.window = logprob_window(config)
        self.eval_outcomes: dict = {}  # the latest evaluation's per-task outcomes (rollout/evaluate.py)
        # The model work of the scoring and the update, counted from their padded shapes like the
        # samplers' (strata_jax/cost.py; bench/iteration.py models an iteration's time from them).
        self.work = {"score": Work(), "update": Work()}
        if for_training:
            self.train_step = make_train_step(
                graphdef,
                self.optimizer,
                loss_config(loss_dict(t)),
                self.mesh,
                micro_batches=int(t.micro_batches),
                logprob_chunk=int(t.logprob_chunk),
                logprob_window=self.window,
            )
        self.adv_params = advantage_params(config)
        self.ptx = self.ptx_step = None
        if for_training and float(t.ptx_coef) > 0:
            from rollout.warmstart import PtxDemos
            from strata_jax.sft import make_ptx_step

            self.ptx = PtxDemos(config, self.tokenizer, self.pad_id)
            self.ptx_step = make_ptx_step(
                graphdef, self.optimizer, self.mesh, chunk=int(t.logprob_chunk), window=self.ptx.window
            )

    def new_policy(self, params, prefix_cache: bool | None = None) -> JaxPolicy:
        """A JaxPolicy over `params` with the config's sampling settings; `prefix_cache` overrides
        `sampling.prefix_cache` (bench/prefix_cache.py runs both side by side)."""
        s = self.config.sampling
        cache = bool(s.prefix_cache) if prefix_cache is None else bool(prefix_cache)
        return JaxPolicy(
            self.decode_graphdef,
            params,
            self.tokenizer,
            {"strategy": s.max_strategy_tokens, "action": s.max_action_tokens, "judge": s.max_judge_tokens},
            prompt_buckets=s.prompt_buckets,
            batch_buckets=s.batch_buckets,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            mesh=self.local_mesh,
            cache_dtype=s.kv_dtype,
            shared_prefix=bool(s.shared_prefix),
            fuse_decode=bool(s.fuse_decode),
            prefix_cache_tokens=int(s.prefix_cache_tokens) if cache else 0,
            prefix_cache_bytes=int(s.prefix_cache_mb) << 20,
            seed=int(self.config.seed),
        )

    def checkpoint_state(self):
        """What a checkpoint holds of the train state: everything but the frozen base (LoRA)."""
        return self.state.replace(frozen=None)

    def reference_params(self):
        """The reference policy's params for the scoring, None without a KL term: the starting
        model's copy, or with LoRA the frozen base with every adapter off (the same logits)."""
        if not uses_reference(self.config.train):
            return None
        if self.lora:
            return lora.join(self.state.frozen, lora.adapters_off(self.state.params))
        return self.ref_params

    def decode_params(self):
        """The params the sampler decodes: the model's, or with LoRA the adapters merged in."""
        if not self.lora:
            return self.state.params
        return self._merge(self.state.frozen, self.state.params)

    def _policy_params(self):
        """The sampler's params for the current train state. Several processes: a local replica
        gathered from every process's shards (a collective; see sync_policy)."""
        self._synced = self.state
        self._decoded = self.decode_params()
        if self.nproc == 1:
            return self._decoded
        return sharding.shard_params(sharding.fetch_global(self._decoded), self.local_mesh)

    @property
    def policy_synced(self) -> bool:
        """Whether the sampler already holds the current train state's params (sync_policy is then
        a no-op, with no collective)."""
        return self._synced is self.state

    def sync_policy(self) -> None:
        """Point the sampler at the current train state. With several processes every process must
        call this at the same point (it gathers the params); it is a no-op when nothing changed,
        which is what lets process 0 evaluate alone right after a synced update."""
        if self._synced is not self.state:
            self.policy.params = self._policy_params()
        elif self.nproc == 1:
            self.policy.params = self._decoded

    def set_temperature(self, temperature: float, strategy_temperature: float | None = None) -> None:
        """Sampling temperature of every call kind; strategy calls get their own when given (>= 0)."""
        from strata_jax.sampling import SamplingParams

        s = self.config.sampling
        self.policy.sampling = SamplingParams(temperature=float(temperature), top_p=s.top_p, top_k=s.top_k)
        self.policy.kind_sampling = {}
        if strategy_temperature is not None and strategy_temperature >= 0:
            self.policy.kind_sampling["strategy"] = SamplingParams(
                temperature=float(strategy_temperature), top_p=s.top_p, top_k=s.top_k
            )
