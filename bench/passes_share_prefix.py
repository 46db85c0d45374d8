"""share-prefix on vs off: n = 8 samples per prompt, prompts four times longer than responses.

    .venv/bin/python bench/passes_share_prefix.py --steps 6

A PPO step with a reward model (four forwards over every rollout: policy and reference log-probs, critic
values, reward-model scores; GPT-2 shaped, 4 layers, width 256) on prompts of 64 characters (65 tokens with
BOS) and responses of exactly 16 tokens (min_tokens = max_tokens = 16), 8 prompts x n = 8. Prompts are random,
so only the n samples of a prompt share it. The affected stage is those four rollout forwards;
generation (whose prefill is shared too) is reported on its own. fuse-gen-inference is off on both sides so
that the forwards run as separate, timeable nodes.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

from passes_common import cli, fmt, lockstep, make_side, save, stage_time

from flowrl.backends.local import LocalBackend
from flowrl.compiler import compile_file

FLOW = """
flow share_prefix_bench
model actor : policy { source = "tiny:gpt2", layers = 4, dim = 256, heads = 4, charset = "0123456789+=", lr = 1e-5 }
model ref : reference { source = actor }
model critic : critic { source = actor, lr = 1e-5 }
model rm : reward_model { source = actor }
data prompts = jsonl("prompts.jsonl") { batch = 8 }
step {
    rollout  = actor.generate(prompts, n = 8, max_tokens = 16, min_tokens = 16)
    old_logp = actor.logprobs(rollout)
    ref_logp = ref.logprobs(rollout)
    values   = critic.values(rollout)
    scores   = rm.score(rollout)
    adv      = gae(scores, values)
    actor.update(rollout, old_logp = old_logp, ref_logp = ref_logp, advantages = adv)
    critic.update(rollout, values = values, returns = adv)
}
"""
FORWARDS = ("old_logp", "ref_logp", "values", "scores")


def write_flow(folder: Path) -> Path:
    rng = random.Random(0)
    rows = ["".join(rng.choice("0123456789+") for _ in range(63)) + "=" for _ in range(256)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    (folder / "flow.flow").write_text(FLOW)
    return folder / "flow.flow"


def measure(steps: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        flow = str(write_flow(Path(tmp)))
        on_g = compile_file(flow, no_pass=["fuse-gen-inference"])
        off_g = compile_file(flow, no_pass=["fuse-gen-inference", "share-prefix"])
        on, off = make_side("on", on_g, LocalBackend()), make_side("off", off_g, LocalBackend())
        row = lockstep(on, off, FORWARDS, steps,
                       extra=lambda a, b: {"generate_on_s": stage_time(a, ("rollout",)),
                                           "generate_off_s": stage_time(b, ("rollout",))})
    row = {"pass": "share-prefix", "workload": "n=8, prompt 65 / response 16 tokens", "workers": 1, **row}
    print(f"share-prefix (n=8, prompt 65 tokens, response 16): {fmt(row)}; generation {row['generate_off_s']:.3f}s "
          f"-> {row['generate_on_s']:.3f}s", flush=True)
    return [row]


def main() -> None:
    args = cli(__doc__ or "")
    save(args.json, measure(args.steps))


if __name__ == "__main__":
    main()
