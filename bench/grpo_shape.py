"""The shared GRPO benchmark shape (bench/): one tiny checkpoint, one prompt set, one reward for every system.

`bench/grpo_vs_trl.py` writes the checkpoint and prompts once; `run_flowrl.py`, `run_trl.py` (in the TRL venv)
and `floor.py` all read them from `bench/out/`, so the three measure the same model on the same data. Nothing is
downloaded: the GPT-2 is randomly initialised from a fixed seed and the tokenizer is built in code.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from flowrl.rewards import arith_partial

BENCH = Path(__file__).resolve().parent
# Two prompt shapes (`grpo_vs_trl.py --shape NAME` sets FLOWRL_BENCH_SHAPE for every child process):
# - "short":   "123+456=", 9 tokens with BOS: almost all the work is the 32 completion tokens.
# - "fewshot": FEWSHOT worked examples ("123+456=579 ") before the question, about 134 tokens: a prompt four
#              times longer than its completion, as in few-shot or system-prompted RLHF, where flowrl's
#              share-prefix pass computes each prompt once for its 8 samples and TRL computes it 8 times.
SHAPES = ("short", "fewshot")
SHAPE = os.environ.get("FLOWRL_BENCH_SHAPE", "short")
if SHAPE not in SHAPES:
    raise SystemExit(f"FLOWRL_BENCH_SHAPE={SHAPE!r}: the shapes are {', '.join(SHAPES)}")
FEWSHOT = 10
OUT = BENCH / "out" if SHAPE == "short" else BENCH / "out" / SHAPE
CKPT = OUT / "ckpt"
PROMPTS_FILE = OUT / "prompts.jsonl"

# Model: GPT-2, 2 layers, width 128, 4 heads, context 256; vocabulary: 13 characters + 4 specials = 17 tokens.
LAYERS, DIM, HEADS, CONTEXT = 2, 128, 4, 256
CHARSET = "0123456789+= "
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
INIT_SEED = 0

# One step: 16 prompts x 8 samples = 128 rows, exactly 32 completion tokens each, one optimizer step.
PROMPTS_PER_STEP, GROUP, COMPLETION = 16, 8, 32
ROWS = PROMPTS_PER_STEP * GROUP
BETA, CLIP, LR, MAX_GRAD_NORM, TEMPERATURE = 0.04, 0.2, 1e-5, 1.0, 1.0
SEED = 0
STEPS, WARMUP = 10, 2  # the first WARMUP steps are dropped; the median is over the other STEPS - WARMUP
N_PROMPTS = 512  # more than STEPS * PROMPTS_PER_STEP, so no run wraps into a second epoch


def reward(prompt: str, response: str, answer: object = None, **_: object) -> float:
    """The benchmark reward: flowrl's digit-agreement arithmetic reward (cheap, pure Python)."""
    return arith_partial(prompt, response, answer=answer)


def prompt_rows() -> list[dict[str, str]]:
    """`N_PROMPTS` three-digit additions, "123+456=" (8 characters; 9 tokens with BOS), with their answers;
    for the "fewshot" shape each is preceded by FEWSHOT solved ones of its own ("123+456=579 ...")."""
    rng = random.Random(SEED)
    rows = []
    for _ in range(N_PROMPTS):
        shots = ""
        if SHAPE == "fewshot":
            pairs = [(rng.randrange(100, 1000), rng.randrange(100, 1000)) for _ in range(FEWSHOT)]
            shots = "".join(f"{x}+{y}={x + y} " for x, y in pairs)
        a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
        rows.append({"prompt": f"{shots}{a}+{b}=", "answer": str(a + b)})
    return rows


def write_inputs() -> None:
    """Write the checkpoint and the prompt file under bench/out/ (idempotent: same bytes every time)."""
    OUT.mkdir(parents=True, exist_ok=True)
    PROMPTS_FILE.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows()), encoding="utf-8")
    write_checkpoint(CKPT)


def write_checkpoint(path: Path) -> None:
    """A randomly initialised GPT-2 and a character-level fast tokenizer, saved with `save_pretrained`."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARSET)}
    vocab.update({s: len(CHARSET) + i for i, s in enumerate(SPECIALS)})
    pad, bos, eos, unk = (vocab[s] for s in SPECIALS)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()  # join characters back without spaces
    # BOS is added by the tokenizer (TRL tokenizes with special tokens); flowrl prepends BOS itself.
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>")  # fmt: skip
    cfg = GPT2Config(
        vocab_size=len(vocab), n_positions=CONTEXT, n_embd=DIM, n_layer=LAYERS, n_head=HEADS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_pytorch_tanh",
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        model = GPT2LMHeadModel(cfg)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)


def steady(times: Sequence[float]) -> list[float]:
    """The steady-state step times: everything after the warm-up steps."""
    return list(times[WARMUP:])


def median(times: Sequence[float]) -> float:
    return statistics.median(times) if times else float("nan")


def cpu_mark() -> tuple[float, float, float]:
    """(wall s, CPU s used by the whole machine, CPU s used by this process): two marks bracket a step."""
    t = os.times()
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        busy = math.nan  # no /proc (not Linux): disturbance is unknown
    return time.perf_counter(), busy, t.user + t.system


def others_cores(marks: Sequence[tuple[float, float, float]]) -> list[float]:
    """Cores kept busy by *other* processes between consecutive marks (0 = we had the machine to ourselves).

    Timings on a shared machine are only as good as this: with 2 torch threads on 2 cores, one busy neighbour
    makes a step several times slower, so the harness reports steps taken while others used < QUIET cores.
    """
    return [max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / max(b[0] - a[0], 1e-9))
            for a, b in zip(marks, marks[1:], strict=False)]  # fmt: skip


def cpu_seconds(marks: Sequence[tuple[float, float, float]]) -> list[float]:
    """CPU seconds this process used between consecutive marks: a second, load-robust measure of the work
    (a neighbour stretches wall time several-fold but CPU time only by the threads' spin-waiting)."""
    return [b[2] - a[2] for a, b in zip(marks, marks[1:], strict=False)]


# A step is "quiet" when other processes used less than this many cores during it. The same bar holds for
# 1-thread runs: on this 2-vCPU VM a neighbour on the other vCPU still slows a 1-thread step by ~30%.
QUIET = 0.25


def write_result(path: str | None, result: dict[str, object]) -> None:
    """Children report to the orchestrator through a JSON file (stdout is left to the libraries' chatter)."""
    if path:
        Path(path).write_text(json.dumps(result, indent=1), encoding="utf-8")
