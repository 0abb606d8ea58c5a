"""Does a model read a word from its prompt? The signpost corridor's copy probe (docs/RESULTS.md).

At the sign's door of the signpost corridor (rollout/envs/doors.py, `sign_at`) the observation
names the colour that opens ("A sign here reads: black. ..."), and the demonstrations always take
that door. A model that reads its prompt puts its probability on that colour; one that does not
spreads it over the listed colours it has seen open there. This scores, teacher-forced with the
run's own forward (strata_jax.train.sequence_logprobs), the next token after
"<action>open the" on held-out corridors, in both prompt styles (with the reset strategy, and
flat), and prints one comparable figure: the mean probability of the sign's colour among the
listed colours, against chance (1 / the colours the sign can name).

    python bench/read_probe.py MODEL_DIR [--doors 6] [--options 6] [--sign-at 3] [--tasks 40]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def probe(
    model_dir: str, doors: int = 6, options: int = 6, sign_at: int = 3, tasks: int = 40, first_seed: int = 10**6
) -> dict:
    """{'p_right', 'argmax_right', 'chance', 'n'}: the sign's colour under the model at its door."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rollout.demos import DOORS_STRATEGY, THINK
    from rollout.envs.doors import COLORS, DoorsEnv
    from rollout.policy import render
    from rollout.prompts import step_prompt
    from strata_jax.models.hf import load_hf_model, load_tokenizer
    from strata_jax.train import sequence_logprobs

    (graphdef, params), _ = load_hf_model(model_dir, split=True)
    tok = load_tokenizer(model_dir)
    colours = COLORS[:options]
    ids = {c: tok.encode(" " + c, add_special_tokens=False) for c in colours}
    if any(len(v) != 1 for v in ids.values()):
        raise SystemExit(f"{model_dir}: the tokenizer splits a colour ({ids}); the probe scores one token")
    env = DoorsEnv(doors=(doors, doors), options=options, sign_at=sign_at)
    rows, right = [], []
    for seed in range(first_seed, first_seed + tasks):
        env.reset(seed=seed)
        for _ in range(sign_at):  # the demonstrator's way to the sign: red before it
            obs, _, _, _, info = env.step("open the red door")
        for strategy in (DOORS_STRATEGY, None):
            msgs = step_prompt(
                "go through every door.",
                obs,
                info["admissible_commands"],
                strategy=strategy,
                step=sign_at,
                history_length=0,
            )
            rows.append(tok.encode(render(msgs, tok) + f"{THINK}<action>open the", add_special_tokens=False))
            right.append(colours.index(env.opens[sign_at]))
    L = max(map(len, rows)) + 1
    cand = np.asarray([ids[c][0] for c in colours])
    logp = np.zeros((len(rows), len(colours)), np.float32)
    score = jax.jit(lambda p, t, m: sequence_logprobs(graphdef, p, t, m, window=1)[0][:, -1])
    for k, c in enumerate(cand):  # one batch per candidate: every row ends with that colour
        toks = np.zeros((len(rows), L), np.int32)
        mask = np.zeros((len(rows), L), bool)
        for s, r in enumerate(rows):  # left padding, as the trainer's rows
            toks[s, L - len(r) - 1 :] = [*r, c]
            mask[s, L - len(r) - 1 :] = True
        logp[:, k] = np.asarray(score(params, jnp.asarray(toks), jnp.asarray(mask)))
    p = np.exp(logp - logp.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)  # among the listed colours
    idx = np.arange(len(rows))
    return {
        "p_right": float(p[idx, right].mean()),
        "argmax_right": float((p.argmax(1) == right).mean()),
        "chance": 1.0 / (options - 1),
        "n": len(rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--doors", type=int, default=6)
    ap.add_argument("--options", type=int, default=6)
    ap.add_argument("--sign-at", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=40)
    a = ap.parse_args()
    r = probe(a.model_dir, a.doors, a.options, a.sign_at, a.tasks)
    print(
        f"p(sign's colour) = {r['p_right']:.3f} (chance {r['chance']:.3f}); argmax right {r['argmax_right']:.3f}; "
        f"{r['n']} prompts"
    )


if __name__ == "__main__":
    main()
