"""All defaults, documented, and the validation every run goes through before any work.

Experiment files start from `base_config()` and change a few fields: configs/paper.py:ALGO,ENV
(`with_algo_env`, the papers' setting of one algorithm on one environment), configs/tiny_*.py.
Command-line overrides: `python launch.py --config configs/paper.py:strata,alfworld --config.algo.delta=0.25`.
An unknown key is reported by launch.py before the config is parsed (one line naming the key and
its close matches, exit 2); a bad value fails in `validate()` below, naming the key and the allowed
values; an option that is configured but not built yet is refused there too.
"""

from __future__ import annotations

import ml_collections as mlc

from rollout.envs import REGISTRY as _WORLDS
from rollout.envs.alfworld import MILESTONE_MODES, SPLITS
from rollout.options import CONFIG_KEYS as ROLLOUT_KEYS
from rollout.options import first_problem as rollout_problem
from strata_jax.names import (
    AGGREGATIONS,
    ALGOS,
    ATTENTION_IMPLS,
    GIGPO_NORMS,
    LORA_TARGETS,
    SCHEDULES,
    SEG_NORMS,
    STEP_WEIGHTINGS,
    STRATA_ALGOS,
)

ENVS = tuple(_WORLDS)  # every world rollout.envs.make_env builds
# Worlds for testing the pipeline, not for studies: configs/paper.py does not offer them.
TEST_ENVS = ("doors",)
# The studies' worlds: configs/paper.py:ALGO,ENV takes ENV from these.
STUDY_ENVS = tuple(e for e in ENVS if e not in TEST_ENVS)
# Worlds generated from a seed, with a built-in expert: held-out tasks are the seeds past
# env.eval_seed_offset, and SFT demonstrations come from the expert (no game files, no sft.demos).
PROCEDURAL_ENVS = ("household", "shop", "doors")
# Worlds whose SFT warm start needs no `sft.demos`: the procedural ones' experts, and ALFWorld, whose
# language the household world speaks (rollout/demos.py: household demonstrations).
EXPERT_DEMOS = (*PROCEDURAL_ENVS, "alfworld")
DTYPES = ("float32", "bfloat16")
# The allowed values of the enumerated keys. The rollout's own (algo.invalid_penalty_tokens,
# env.action_format) are checked with the rest of its rules (rollout/options.py, in validate()).
CHOICES = {
    "algo.name": ALGOS,
    "algo.milestones": MILESTONE_MODES,
    "algo.gigpo_norm": GIGPO_NORMS,
    "algo.seg_norm": SEG_NORMS,
    "algo.task_sampling": ("uniform", "by_type"),
    "env.name": ENVS,
    "env.split": SPLITS,
    "env.eval_split": SPLITS,
    "model.dtype": DTYPES,
    "model.param_dtype": DTYPES,
    "model.attention": ATTENTION_IMPLS,
    "sampling.kv_dtype": DTYPES,
    "train.aggregation": AGGREGATIONS,
    "train.step_weighting": STEP_WEIGHTINGS,
    "train.schedule": SCHEDULES,
    "sft.styles": ("own", "both"),
}


def base_config() -> mlc.ConfigDict:
    c = mlc.ConfigDict()
    c.seed = 0
    c.iterations = 100  # training iterations (rollout -> advantages -> update)

    # --- algorithm (ALGORITHMS.md) ---------------------------------------------------------------
    a = c.algo = mlc.ConfigDict()
    a.name = "strata"  # one of ALGOS
    a.tasks_per_iter = 16  # P
    # How an iteration's P task seeds are drawn: "uniform" over the training seeds, or "by_type"
    # (household): the task types in turn, so every update sees each type as often as the others
    # (on the household world, updates on one type's groups moved success away from the others).
    a.task_sampling = "uniform"
    a.group_size = 8  # G, trajectories per task for flat algorithms (N = 1, M = G)
    a.num_strategies = 4  # N (StraTA)
    a.traj_per_strategy = 8  # M (StraTA)
    a.oversample = 8  # sigma: sample sigma * N strategy candidates, keep N
    a.diverse = True  # farthest-point selection on (False: the first N candidates)
    a.judgment = True  # self-judgment step penalties on
    a.judge_train = False  # train the judgment tokens (GRPO over judge.samples >= 2; docs/CONTRACTS.md)
    a.revise_every = 0  # revise the strategy before steps K, 2K, ... (0 = off; beyond the paper; strata only)
    a.milestones = "facts"  # BEACON milestone source: game facts or the expert plan
    a.delta = 0.5  # top-delta share of a strategy's returns
    a.kappa = 0.1  # self-judgment penalty per bad step
    a.gamma = 0.95  # GiGPO step-return discount
    a.beacon_gamma = 0.9  # BEACON temporal shaping discount
    a.lam_strategy = 0.5  # weight of the strategy-level loss
    a.lam_seg = 1.0  # BEACON segment advantage weight
    a.omega = 1.0  # GiGPO step advantage weight
    a.invalid_penalty = 0.1
    # where it lands: the wrong command's tokens; "divergence" the one token where it left every
    # admissible command; "response" all of the response (docs/CONTRACTS.md)
    a.invalid_penalty_tokens = "action"
    a.r_succ = 10.0
    a.r_ms = 10.0
    a.c_len = 0.1
    a.c_fmt = 0.1
    a.strategy_budget = 64  # L_z, strategy token budget
    a.stats_over_steps = False
    a.gigpo_norm = "std"
    a.seg_norm = "mean"

    # --- self-judgment (docs/CONTRACTS.md) -------------------------------------------------------
    j = c.judge = mlc.ConfigDict()
    j.samples = 1  # k judgments per trajectory; the strict-majority set is penalised (1 = ALGORITHMS 3.4)

    # --- environment -------------------------------------------------------------------------------
    e = c.env = mlc.ConfigDict()
    e.name = "household"
    e.max_steps = 30
    e.history_length = 2
    e.show_first_observation = True  # step prompts repeat the first observation (rollout/prompts.py)
    e.horizon_min = 2  # household / shop / doors: L* range of generated tasks
    e.horizon_max = 12
    e.extra_receptacles = 4  # household: filler receptacles beyond the task's own
    e.distractors = 6  # household: unrelated objects placed around the room
    e.reveal_objects = False  # household: the first observation says where the task's objects are
    # How the agent names its action: "text" = the command itself (ALFWorld's, verl-agent's);
    # "index" (household) = the number of a command in the prompt's numbered admissible list, so
    # that no answer in range is inadmissible (text-game agents with a fixed action set choose so).
    e.action_format = "text"
    e.doors_options = 2  # doors (the learnability test world): doors listed per step; L* from horizon_min/max
    e.doors_sign_at = 0  # doors: from door s+1 on a colour shown only there opens (0 = none; rollout/envs/doors.py)
    e.data_dir = "data/alfworld"  # alfworld: where ../shared/data/alfworld/*.tar.xz are unpacked
    e.cache_dir = ""  # alfworld: translated-game cache shared by workers and runs ("" = in memory only)
    e.split = "train"
    e.eval_split = "valid_unseen"
    e.num_workers = 0  # 0 = in-process pool; > 0 worker processes
    e.timeout_s = 60.0  # a worker silent this long is restarted and its trajectory masked out
    e.eval_seed_offset = 1_000_000  # household / shop: held-out tasks come from seeds above this
    e.shop_catalog_seed = 0  # shop: the catalogue (products, prices, options) is generated from this
    e.shop_products = 24000  # shop: catalogue size (203 categories)
    e.shop_page_size = 10  # shop: results per page (WebShop: 10, of 50 results)

    # --- model ------------------------------------------------------------------------------------
    m = c.model = mlc.ConfigDict()
    m.path = ""  # a local Hugging Face directory; "" = build the tiny model (below) in the workdir
    m.dtype = "float32"
    m.param_dtype = "float32"
    m.scan_layers = False
    m.remat = False
    m.attention = "einsum"  # "cudnn": fused flash attention for the update and prefill (GPU, bf16)
    # LoRA (strata_jax/lora.py): rank > 0 trains adapters on `lora_targets` over the frozen model, the
    # reference policy is that model (adapters off), the sampler decodes the merged weights; the
    # SFT warm start still trains every weight. 0 = full fine-tuning.
    m.lora_rank = 0
    m.lora_alpha = 16.0
    m.lora_targets = tuple(LORA_TARGETS)  # any of these projections: q, k, v, o, gate, up, down
    m.tiny_hidden = 64
    m.tiny_layers = 2
    m.tiny_heads = 4
    m.tiny_kv_heads = 2
    m.tiny_intermediate = 128
    m.tiny_vocab = 512

    # --- sampling ---------------------------------------------------------------------------------
    s = c.sampling = mlc.ConfigDict()
    s.temperature = 1.0
    s.eval_temperature = 0.4
    # Strategy calls of training rollouts only (StraTA); < 0 = the same as temperature. A long strategy
    # drawn at T = 1 by a weak model is mostly noise, and every action of its M trajectories is
    # conditioned on it; evaluation draws everything at eval_temperature.
    s.strategy_temperature = -1.0
    s.top_p = 1.0
    s.top_k = 0
    s.max_action_tokens = 48
    s.max_strategy_tokens = 64
    s.max_judge_tokens = 32
    s.prompt_buckets = (128, 256, 512, 1024, 2048)
    s.batch_buckets = (8, 16, 32, 64, 128, 256, 512)
    s.kv_dtype = "float32"
    # Prefill each common prompt prefix once (the intro, task, strategy and start memory that the M
    # trajectories of a strategy share) and copy its keys and values to the rows that start with it
    # (strata_jax/prefix.py); the samples are the unshared prefill's up to float rounding.
    s.shared_prefix = True
    # Keep each prompt's first `prefix_cache_tokens` tokens' keys and values across the calls of a
    # rollout (the head every step prompt of a trajectory repeats: intro, task, strategy, start
    # memory) and prefill only the rest of the next prompt that starts with them
    # (strata_jax/prefix.py PrefixCache), in the action calls' sampler. Cleared whenever the
    # sampler's params change. At most `prefix_cache_mb` MB of keys and values; the samples are the
    # uncached prefill's up to float rounding.
    s.prefix_cache = False
    s.prefix_cache_tokens = 256
    s.prefix_cache_mb = 512
    # Decode with each layer's q / k / v and gate / up kernels fused into one matmul each, on
    # weights cast to the compute dtype once per call (strata_jax.models.qwen2.prepare_decode).
    # The fused copy costs about 0.7x the layers' weights in the compute dtype while a call
    # decodes; False keeps the model's own kernels (the samples agree up to float rounding).
    s.fuse_decode = True

    # --- update (ALGORITHMS.md 5) -----------------------------------------------------------------
    t = c.train = mlc.ConfigDict()
    t.lr = 1e-6
    t.weight_decay = 0.01
    t.grad_clip = 1.0
    t.schedule = "constant"
    t.warmup_steps = 0
    t.eps_low = 0.2
    t.eps_high = 0.2
    t.dual_clip = 3.0
    t.kl_coef = 0.01  # 0: no KL term, so no reference params kept and no reference scoring pass
    t.entropy_coef = 0.0  # ALGORITHMS.md: entropy bonus 0.001 is an option
    t.aggregation = "token_mean"
    # "step": every step row weighs the same; "trajectory": a trajectory's steps share one weight
    # (long losing trajectories no longer outweigh short wins; strata_jax/advantages/weighting.py)
    t.step_weighting = "step"
    t.mini_batch_rows = 256  # rows (LLM calls) per optimiser step; one epoch per iteration
    t.micro_batches = 1  # gradient accumulation inside one step
    t.skip_no_signal = True  # skip mini-batches whose advantages are all 0 (no KL/decay-only drift)
    t.length_buckets = (128, 256, 512, 1024, 2048)
    t.logprob_chunk = 8192  # vocabulary chunk for log-probs
    # Re-score old log-probs with the training forward (as verl does) rather than trusting the
    # sampler's: they agree in fp32, but differ in bf16, which would bias the PPO ratio.
    t.recompute_old_logp = True
    # Run each common prompt prefix of a mini-batch once in the update and in the scoring, the rows'
    # remainders attending to its keys and values (strata_jax/packing.py): the same log-probs, loss
    # and update up to float rounding, fewer tokens through the model (StraTA's M trajectories of a
    # strategy share their intro, task, strategy and start memory). The population update
    # (`ablate --train`) runs unshared.
    t.shared_prefix = True
    # Score rows as prefix trees (strata_jax/tree.py) where that costs the model less than the plain
    # rows or one level of shared prefix: every distinct prefix of mini_batch_rows sorted rows per
    # device once (the intro, task and strategy, a trajectory's common history, repeated prompts),
    # each token attending to its root path. The same log-probs up to float rounding
    # (tests/test_tree.py); 34-46% fewer scoring tokens on ALFWorld rows (docs/BENCHMARKS.md, "Rows
    # as prefix trees").
    t.prefix_tree = True
    # The same for the update's mini-batches (per micro-batch and device), the same update up to
    # float rounding. Off by default: it paid only at the paper's shape (GRPO -17%, StraTA -5% of
    # update tokens; nothing with 64-row mini-batches at M = 8), and each packed shape compiles a
    # train step of its own (on the CPU the embedded default's update took 126 s instead of 94 s).
    t.prefix_tree_update = False
    # With shared_prefix: the prefix and remainder widths the packing may pick, as sizes per octave
    # (strata_jax/packing.length_buckets; train.length_buckets are added to them). 2: 256, 384,
    # 512, 768, ...; 8: 512, 576, 640, ... More steps pad less (rows of 520-570 tokens take 576
    # slots, not 768) but compile more update programs (the persistent jit cache keeps them).
    t.bucket_steps = 2
    # PPO-ptx (InstructGPT), as interleaved steps: before every policy-update mini-batch, one step on
    # ptx_coef x the mean NLL of `ptx_rows` demonstration rows (the warm start's own demonstrations,
    # of every task type), through the same optimiser. Solved tasks have zero advantage, so nothing
    # else holds them while RL moves the policy for the tasks that do have signal (docs/RESULTS.md).
    # 0 = off.
    t.ptx_coef = 0.0
    t.ptx_rows = 16
    t.ptx_tasks = 256  # demonstration tasks the ptx rows are drawn from (the SFT split's first ones)
    # False: the update runs its ptx steps only, no policy-gradient step (the control that shows
    # what RL adds on top of continued SFT); needs ptx_coef > 0.
    t.rl_update = True

    # --- SFT warm start -------------------------------------------------------------------------
    f = c.sft = mlc.ConfigDict()
    f.steps = 200
    f.lr = 1e-3
    f.batch_rows = 32
    f.demos = ""  # JSONL of demonstrations (ALFWorld); household uses its expert solver
    f.num_tasks = 256
    f.epsilon = 0.0  # household: epsilon-soft expert (detours with this probability, then recovers)
    f.styles = "own"  # household demos in this run's prompt style, or "both" (strategy + flat prompts)
    f.judge_share = 1.0  # household: share of the demo tasks whose self-judgment is a demo row too
    # A first phase of `read_steps` steps at `read_lr` whose loss is only on the answer tokens copied
    # from the prompt's content (strata_jax.sft.read_token_weights: tokens in at most
    # `read_max_share` of the prompts), then `steps` on whole answers: without it the tiny models
    # never learn to read a word from their prompt (docs/RESULTS.md; tests/test_read_sft.py).
    f.read_steps = 0
    f.read_lr = 2e-3
    f.read_max_share = 0.25  # a style mix (sft.styles="both") puts the strategy template in half the prompts

    # --- evaluation, checkpoints, logging, mesh -------------------------------------------------
    v = c.eval = mlc.ConfigDict()
    v.every = 10  # iterations between evaluations (0 = off)
    v.num_tasks = 64
    v.greedy = True  # also evaluate with greedy decoding
    # Evaluate the starting model before iteration 1. Off for runs that share one start evaluated
    # once (bench/learning.py --world smol: every arm starts from the same SFT model).
    v.at_start = True

    k = c.checkpoint = mlc.ConfigDict()
    k.every = 5
    k.keep = 3
    k.async_save = False

    g = c.log = mlc.ConfigDict()
    g.progress = True
    # also the per-step bar inside each rollout (on a terminal one redraw per step; in a log a line
    # at most every 10 s)
    g.rollout_progress = False
    g.plots_every = 1
    g.save_batches = True  # keep each iteration's TrajectoryBatch for `launch.py ablate`

    h = c.mesh = mlc.ConfigDict()
    h.data = 1
    h.fsdp = -1  # -1 = all remaining devices
    h.tensor = 1
    h.distributed = False  # jax.distributed.initialize() (multi-host GPU / TPU pods; docs/TPU.md)
    # initialize() arguments; unset ("" / 0 / -1) falls back to the environment variables
    # JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, then to jax's auto-detection
    # (Cloud TPU, SLURM, Open MPI).
    h.coordinator_address = ""  # "host:port" of process 0
    h.num_processes = 0
    h.process_id = -1
    h.local_device_ids = ""  # e.g. "0,1": this process's accelerators ("" = all visible)
    # Rollouts of an iteration are collected in this many shards of P / shards tasks, each with its
    # own sampling keys (0 = one shard per process). Process h collects shards h*S/H .. (h+1)*S/H-1,
    # so a run on H processes is replayed exactly on one process with rollout_shards=H.
    h.rollout_shards = 0
    return c


def _get(c: mlc.ConfigDict, dotted: str):
    for part in dotted.split("."):
        c = c[part]
    return c


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key."""


def validate(c: mlc.ConfigDict) -> mlc.ConfigDict:
    """Check every enumerated and numeric field; raise ConfigError naming the key."""
    for key, allowed in CHOICES.items():
        val = _get(c, key)
        if val not in allowed:
            raise ConfigError(f"config.{key}={val!r} is not allowed; choose one of {list(allowed)}")
    # The rollout's settings (group sizes, max steps, revision, judgment, penalty tokens, action
    # format): the rules RolloutConfig.validate applies too, named by their config keys here.
    problem = rollout_problem(
        {field: _get(c, key) for field, key in ROLLOUT_KEYS.items()},
        strata=c.algo.name in STRATA_ALGOS,
        name=lambda field: f"config.{ROLLOUT_KEYS[field]}",
        algo=repr(c.algo.name),
    )
    if problem:
        raise ConfigError(problem)
    positive = [
        "iterations",
        "algo.tasks_per_iter",
        "train.micro_batches",
        "sampling.max_action_tokens",
        "sampling.max_strategy_tokens",
        "sampling.max_judge_tokens",
        "checkpoint.keep",
        "algo.strategy_budget",
        "sampling.prefix_cache_tokens",
        "sampling.prefix_cache_mb",
    ]
    for key in positive:
        if _get(c, key) < 1:
            raise ConfigError(f"config.{key}={_get(c, key)!r} must be >= 1")
    nonneg = [
        "algo.kappa",
        "algo.invalid_penalty",
        "algo.lam_strategy",
        "algo.lam_seg",
        "algo.omega",
        "train.lr",
        "train.kl_coef",
        "train.entropy_coef",
        "eval.every",
        "checkpoint.every",
        "env.history_length",
        "env.num_workers",
        "env.extra_receptacles",
        "env.distractors",
        "sft.steps",
        "sft.read_steps",
    ]
    for key in nonneg:
        if _get(c, key) < 0:
            raise ConfigError(f"config.{key}={_get(c, key)!r} must be >= 0")
    for key in ("algo.delta", "algo.gamma", "algo.beacon_gamma"):
        if not 0.0 < _get(c, key) <= 1.0:
            raise ConfigError(f"config.{key}={_get(c, key)!r} must be in (0, 1]")
    if int(c.train.bucket_steps) not in (1, 2, 4, 8, 16):
        raise ConfigError(
            f"config.train.bucket_steps={c.train.bucket_steps}: expected 1, 2, 4, 8 or 16 sizes per octave"
        )
    if not 0.0 <= c.sft.epsilon <= 1.0:
        raise ConfigError(f"config.sft.epsilon={c.sft.epsilon!r} must be in [0, 1]")
    if c.sft.epsilon and c.env.name != "household":
        raise ConfigError(
            f"config.sft.epsilon={c.sft.epsilon!r} is only wired for the household expert, not env.name={c.env.name!r}"
        )
    if not 0.0 < c.sft.read_max_share <= 1.0:
        raise ConfigError(f"config.sft.read_max_share={c.sft.read_max_share!r} must be in (0, 1]")
    if not 0.0 <= c.sft.judge_share <= 1.0:
        raise ConfigError(f"config.sft.judge_share={c.sft.judge_share!r} must be in [0, 1]")
    if not 0.0 < c.sampling.top_p <= 1.0:
        raise ConfigError(f"config.sampling.top_p={c.sampling.top_p!r} must be in (0, 1]")
    if c.sampling.strategy_temperature >= 0 and c.algo.name not in STRATA_ALGOS:
        raise ConfigError(
            f"config.sampling.strategy_temperature={c.sampling.strategy_temperature!r} is set, but "
            f"algo.name={c.algo.name!r} samples no strategies (set it to -1)"
        )
    if c.sampling.temperature < 0 or c.sampling.eval_temperature < 0:
        raise ConfigError("config.sampling.temperature / eval_temperature must be >= 0")
    if not 1 <= c.env.horizon_min <= c.env.horizon_max:
        raise ConfigError(
            f"config.env.horizon_min={c.env.horizon_min} / horizon_max={c.env.horizon_max}: need 1 <= min <= max"
        )
    if c.algo.diverse and c.algo.oversample < 2:  # farthest-point over N of N candidates keeps them all
        raise ConfigError(
            f"config.algo.diverse=True selects N strategies among oversample x N candidates, but "
            f"config.algo.oversample={c.algo.oversample} samples only N: set --config.algo.oversample=4 (or more) "
            "or --config.algo.diverse=False"
        )
    if c.algo.judgment and c.algo.name not in STRATA_ALGOS:
        raise ConfigError(
            f"config.algo.judgment=True is only wired for {' / '.join(STRATA_ALGOS)}, not {c.algo.name!r}: "
            "set --config.algo.judgment=False"
        )
    if c.env.shop_page_size < 1 or c.env.shop_products < 1000:
        raise ConfigError(
            f"config.env.shop_page_size={c.env.shop_page_size} must be >= 1 and "
            f"config.env.shop_products={c.env.shop_products} >= 1000"
        )
    targets = tuple(c.model.lora_targets)
    if (
        c.model.lora_rank < 0
        or c.model.lora_alpha <= 0
        or not targets
        or not set(targets) <= set(LORA_TARGETS)
        or len(set(targets)) != len(targets)
    ):
        raise ConfigError(
            f"config.model.lora_rank={c.model.lora_rank!r} must be >= 0, lora_alpha="
            f"{c.model.lora_alpha!r} > 0, and lora_targets={targets!r} distinct names among "
            f"{', '.join(LORA_TARGETS)}"
        )
    if c.model.attention == "cudnn" and c.model.dtype != "bfloat16":
        raise ConfigError(f"config.model.attention='cudnn' needs config.model.dtype='bfloat16', not {c.model.dtype!r}")
    if c.env.reveal_objects and c.env.name != "household":
        raise ConfigError(f"config.env.reveal_objects=True is only wired for env.name='household', not {c.env.name!r}")
    _refuse_unbuilt(c)
    _check_batch_buckets(c)
    if not 0.0 < c.train.eps_low < 1.0 or c.train.eps_high <= 0:
        raise ConfigError(
            f"config.train.eps_low={c.train.eps_low!r} must be in (0, 1) and "
            f"config.train.eps_high={c.train.eps_high!r} > 0"
        )
    if c.train.dual_clip <= 1:
        raise ConfigError(f"config.train.dual_clip={c.train.dual_clip!r} must be > 1")
    for key in ("sampling.prompt_buckets", "sampling.batch_buckets", "train.length_buckets"):
        b = tuple(_get(c, key))
        ints = all(isinstance(x, int) and not isinstance(x, bool) for x in b)
        if not b or not ints or list(b) != sorted(set(b)) or b[0] < 1:
            raise ConfigError(f"config.{key}={b!r} must be strictly ascending positive ints")
    _validate_mesh(c)
    if c.env.action_format == "index" and c.env.name != "household":
        raise ConfigError(
            f"config.env.action_format='index' is only wired for env.name='household' (its "
            f"expert answers by number), not {c.env.name!r}"
        )
    if c.algo.task_sampling == "by_type" and c.env.name != "household":
        raise ConfigError(
            f"config.algo.task_sampling='by_type' is only wired for env.name='household', not {c.env.name!r}"
        )
    if c.train.ptx_coef < 0 or c.train.ptx_rows < 1 or c.train.ptx_tasks < 1:
        raise ConfigError(
            f"config.train.ptx_coef={c.train.ptx_coef!r} must be >= 0 and train.ptx_rows="
            f"{c.train.ptx_rows!r} / train.ptx_tasks={c.train.ptx_tasks!r} >= 1"
        )
    if c.train.ptx_coef > 0 and c.env.name not in PROCEDURAL_ENVS and not c.sft.demos:
        raise ConfigError(
            f"config.train.ptx_coef={c.train.ptx_coef!r} needs demonstrations: env.name="
            f"{c.env.name!r} has no built-in expert, so set config.sft.demos (JSONL)"
        )
    if not c.train.rl_update and c.train.ptx_coef <= 0:
        raise ConfigError(
            "config.train.rl_update=False leaves the update nothing to do: it is the ptx-only "
            "control and needs config.train.ptx_coef > 0"
        )
    if c.train.micro_batches > c.train.mini_batch_rows or c.train.mini_batch_rows % c.train.micro_batches:
        raise ConfigError(
            f"config.train.micro_batches={c.train.micro_batches} must divide "
            f"config.train.mini_batch_rows={c.train.mini_batch_rows}"
        )
    return c


def _refuse_unbuilt(c: mlc.ConfigDict) -> None:
    """Options that exist in the config but have no code behind them yet: refused before any work,
    never ignored, and never left to fail at rollout time after the SFT warm start."""
    if c.judge.samples > 1 and not c.algo.judgment:
        raise ConfigError(f"config.judge.samples={c.judge.samples!r} needs config.algo.judgment=True")
    if c.algo.milestones != "facts" and c.env.name != "alfworld":
        raise ConfigError(
            f"config.algo.milestones={c.algo.milestones!r} is only wired for env.name='alfworld', "
            f"not {c.env.name!r} (its milestones come from the environment)"
        )


def _check_batch_buckets(c: mlc.ConfigDict) -> None:
    """The sampler batches every policy call of a kind into one program of at most
    max(sampling.batch_buckets) rows: a larger call would fail only at rollout or eval time, after
    SFT; refuse it here. Calls: strategy candidates P*sigma*N, actions and revisions P*N*M (flat:
    P*G), judgments P*N*M*judge.samples, evaluation eval.num_tasks."""
    a = c.algo
    strata = a.name.startswith("strata")
    per_task = a.num_strategies * a.traj_per_strategy if strata else a.group_size
    need = {"algo.tasks_per_iter x trajectories per task": a.tasks_per_iter * per_task}
    if a.judgment:
        need["algo.tasks_per_iter x trajectories per task x judge.samples"] = (
            a.tasks_per_iter * per_task * c.judge.samples
        )
    if strata:
        need["algo.tasks_per_iter x oversample x num_strategies"] = a.tasks_per_iter * a.oversample * a.num_strategies
    if c.eval.every:
        need["eval.num_tasks"] = c.eval.num_tasks
    largest = max(c.sampling.batch_buckets)
    for what, n in need.items():
        if n > largest:
            raise ConfigError(
                f"config.sampling.batch_buckets={tuple(c.sampling.batch_buckets)}: a policy call of "
                f"{what} = {n} rows exceeds the largest bucket {largest}; add a bucket >= {n}"
            )


def _validate_mesh(c: mlc.ConfigDict) -> None:
    h = c.mesh
    if h.num_processes < 0 or h.rollout_shards < 0:
        raise ConfigError(
            f"config.mesh.num_processes={h.num_processes} / rollout_shards={h.rollout_shards} must be >= 0 (0 = unset)"
        )
    if h.process_id < -1:
        raise ConfigError(f"config.mesh.process_id={h.process_id} must be >= 0 (or -1 = unset)")
    if not h.distributed and (h.coordinator_address or h.num_processes > 1 or h.process_id >= 0 or h.local_device_ids):
        raise ConfigError(
            "config.mesh.coordinator_address / num_processes / process_id / local_device_ids "
            "only apply with --config.mesh.distributed=True"
        )
    if h.num_processes and h.process_id >= h.num_processes:
        raise ConfigError(f"config.mesh.process_id={h.process_id} must be < num_processes={h.num_processes}")
    p = c.algo.tasks_per_iter
    if h.rollout_shards and p % h.rollout_shards:
        raise ConfigError(
            f"config.algo.tasks_per_iter={p} must divide by config.mesh.rollout_shards={h.rollout_shards}"
        )
    shards = h.rollout_shards or h.num_processes
    if h.num_processes and shards % h.num_processes:
        raise ConfigError(
            f"config.mesh.rollout_shards={h.rollout_shards} must be a multiple of "
            f"num_processes={h.num_processes} (every process collects whole shards)"
        )
    if shards and p % shards:
        raise ConfigError(
            f"config.algo.tasks_per_iter={p} must divide by the {shards} rollout shards "
            "(config.mesh.num_processes / rollout_shards): each shard collects P / shards tasks"
        )


def get_config() -> mlc.ConfigDict:
    return base_config()


def with_algo_env(c: mlc.ConfigDict, algo: str, env: str) -> mlc.ConfigDict:
    """The per-environment defaults of ALGORITHMS.md section 7 for one algorithm."""
    c.algo.name = algo
    c.env.name = env
    strata = algo.startswith("strata")
    c.algo.judgment = strata  # self-judgment belongs to StraTA; flat algorithms never read it
    c.algo.diverse = strata
    if env == "alfworld":
        c.env.max_steps = 30 if algo == "beacon" else 50
    elif env == "scienceworld":
        c.env.max_steps = 50
    elif env == "shop":
        c.env.max_steps = 15  # verl-agent's WebShop budget
        c.env.horizon_min, c.env.horizon_max = 3, 9  # L* = 3 + pages turned + options (rollout/envs/shop.py)
    else:
        c.env.max_steps = 30
    return c


def load_config_file(spec: str) -> mlc.ConfigDict:
    """The config of a config file as `--config` names it: "path.py" or "path.py:ARG" (ARG passed to
    its get_config, as ml_collections does)."""
    import importlib.util

    path, *args = str(spec).split(":", 1)
    module_spec = importlib.util.spec_from_file_location("_config_file", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(*args)


def start_from(c: mlc.ConfigDict, model_path) -> mlc.ConfigDict:
    """c set to start from an already warm-started model (a run's sft_model/): model.path is that
    directory and SFT is off, so the run does not warm-start it a second time."""
    c.model.path = str(model_path)
    c.sft.steps = 0
    c.sft.read_steps = 0
    return c


def apply_overrides(c: mlc.ConfigDict, items) -> mlc.ConfigDict:
    """`KEY=VALUE` strings (the benches' `--set`) applied to c in place: a Python literal, or a bare
    word as a string (`train.minibatch_order=grouped`). An unknown key raises, as launch.py's do."""
    import ast

    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        *parents, leaf = key.split(".")
        try:
            target = c
            for name in parents:
                target = target[name]
            target[leaf]  # noqa: B018  (an unknown key raises here)
        except (KeyError, AttributeError, IndexError):
            raise ConfigError(f"--set {item!r}: the config has no key {key!r}") from None
        try:
            target[leaf] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            target[leaf] = value
    return c
