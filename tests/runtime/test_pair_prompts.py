"""Preference data as a model reads it (flowrl.runtime.pairs, flowrl.runtime.prompts, issue 34 item 5): a pair's
two sides under one prompt cut once (BOS kept), one BOS whether or not the chat template writes it, and held-out
evaluation in micro-batches, its memory flat in the held-out set's size and its numbers those of one forward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from flowrl.algos.preference import bradley_terry_loss, dpo_loss, sequence_logp
from flowrl.engines.forward import forward_logprobs
from flowrl.models.build import ModelSpec, build_model
from flowrl.models.tokenizer import CharTokenizer, HFTokenizer
from flowrl.runtime import preference_update
from flowrl.runtime.batch import Batch
from flowrl.runtime.pairs import demo_batch, pair_batch
from flowrl.runtime.preference import pair_scores, sft_micro_loss
from flowrl.runtime.preference_update import (
    EVAL_LOGITS,
    EVAL_REF,
    EVAL_ROWS,
    PairUpdate,
    evaluate,
    held_out_forward,
    rows_batch,
    token_rows,
)
from flowrl.runtime.prompts import PromptEncoder, prompt_texts

ROOT = Path(__file__).resolve().parents[2]
INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def _real(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [[t for t, m in zip(r, mk, strict=True) if m] for r, mk in zip(ids.tolist(), mask.tolist(), strict=True)]


def test_a_pairs_prompt_is_cut_once_for_both_sides_and_keeps_its_bos() -> None:
    """The issue's case: a 300-token prompt, a short chosen and a long rejected response, context 512. On main the
    chosen row kept 301 prompt tokens (BOS + 300) and the rejected one 256 without its BOS: DPO and Bradley-Terry
    compared log-probs under different contexts."""
    tok = CharTokenizer("0123456789abcdefghij")
    prompt = "".join("abcdefghij"[i % 10] for i in range(300))
    b = pair_batch(rows_batch([{"prompt": prompt, "chosen": "1" * 9, "rejected": "2" * 249}]), tok, context=512)
    prompts = _real(b["prompt_ids"], b["prompt_mask"])
    responses = _real(b["response_ids"], b["response_mask"])
    assert prompts[0] == prompts[1]  # one prompt for both sides
    assert prompts[0][0] == tok.bos_id and prompts[0][1:] == tok.encode(prompt)[-(len(prompts[0]) - 1):]
    assert len(prompts[0]) == 512 - 250  # cut as little as the longer response (249 + EOS) needs
    assert [len(r) for r in responses] == [10, 250]  # both responses whole
    # responses longer than half the context: the prompt keeps half of it (its BOS among them), they their start
    b = pair_batch(rows_batch([{"prompt": prompt, "chosen": "1" * 400, "rejected": "2"}]), tok, context=512)
    prompts = _real(b["prompt_ids"], b["prompt_mask"])
    assert prompts[0] == prompts[1] and len(prompts[0]) == 256 and prompts[0][0] == tok.bos_id
    assert [len(r) for r in _real(b["response_ids"], b["response_mask"])] == [256, 2]
    demos = demo_batch(rows_batch([{"prompt": prompt, "response": "3" * 400}]), tok, context=512)
    assert _real(demos["prompt_ids"], demos["prompt_mask"])[0] == prompts[0]


def test_a_generation_prompt_cut_to_the_context_keeps_its_bos() -> None:
    tok = CharTokenizer("ab")
    ids = PromptEncoder(tok, context=8).ids(["ab" * 10, "ab"], max_tokens=3)
    assert ids == [[tok.bos_id, *tok.encode("ab" * 10)[-4:]], [tok.bos_id, *tok.encode("ab")]]


def _bos_template_tokenizer(path: Path) -> HFTokenizer:
    """A character-level Hugging Face tokenizer with a BOS whose chat template writes it first, as Llama-2/3's,
    Mistral's and Gemma's do (built here and saved with save_pretrained; nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    charset = "0123456789+=:abcdefghijklmnopqrstuvwxyz "
    vocab = {c: i for i, c in enumerate(charset)} | {s: len(charset) + i for i, s in
                                                    enumerate(["<eos>", "<unk>", "<pad>", "<bos>"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<bos>")
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(path)
    return HFTokenizer(str(path))


def test_a_chat_template_that_writes_the_bos_gets_no_second_one(tmp_path: Path) -> None:
    tok = _bos_template_tokenizer(tmp_path / "tok")
    assert tok.bos_id is not None
    chat = [{"role": "user", "content": "1+2="}]
    rendered = tok.hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<bos>") and tok.encode(rendered)[0] == tok.bos_id  # the template wrote it
    b = pair_batch(rows_batch([{"prompt": chat, "chosen": "3", "rejected": "4"},
                               {"prompt": "1+2=", "chosen": "3", "rejected": "4"}]), tok, context=64)
    prompts = _real(b["prompt_ids"], b["prompt_mask"])
    assert prompts[0] == tok.encode(rendered)  # one BOS, the template's
    assert prompts[2] == [tok.bos_id, *tok.encode("1+2=")]  # a text prompt gets the tokenizer's
    assert [p.count(tok.bos_id) for p in prompts] == [1, 1, 1, 1]
    generated = Batch(1, {}, {"prompt": ["ignored"], "messages": [chat]})
    ids = PromptEncoder(tok, context=64).ids(prompt_texts(generated, tok), max_tokens=4)
    assert ids == [tok.encode(rendered)]


def _model(role: str, seed: int) -> Any:
    return build_model(ModelSpec("tiny:gpt2", {"layers": 1, "dim": 16, "heads": 2, "charset": "0123456789+="},
                                 role=role), seed=seed)


def _sums(n: int) -> list[dict[str, Any]]:
    """Pairs (and demonstrations) of varied lengths, so micro-batches pad to different widths."""
    rows = []
    for i in range(n):
        a, b, right = i % 7, (i * 3) % 10, str(i % 7 + (i * 3) % 10)
        rows.append({"prompt": f"{a}+{b}=" + "0" * (i % 5), "chosen": right, "rejected": str(int(right) + 1) * (i % 3 + 1),
                     "response": right * (i % 4 + 1)})
    return rows


@pytest.mark.parametrize("logits", [1, 6 * 64 * 16, EVAL_LOGITS])  # a pair a forward, 3 (6 rows x 64 x 16), all
def test_held_out_evaluation_in_micro_batches_equals_one_forward(monkeypatch: pytest.MonkeyPatch,
                                                                 logits: int) -> None:
    monkeypatch.setattr(preference_update, "EVAL_LOGITS", logits)
    rows = _sums(13)
    held = rows_batch(rows)
    policy, ref, rm = _model("policy", 0), _model("reference", 1), _model("reward_model", 2)
    tok = policy.tokenizer
    job = PairUpdate(policy.module, tok, 64, torch.device("cpu"))
    pairs = token_rows(held, tok, 64)  # every row at once: what the evaluation did before
    inputs = [pairs[k] for k in INPUTS]
    ref_logp = forward_logprobs(ref.module, *inputs)
    with torch.no_grad():
        for kind in ("sigmoid", "ipo", "simpo"):
            got = evaluate(job, held, {"loss": "dpo", "dpo": kind, "beta": 0.1, EVAL_REF: ref_logp})
            mean = kind != "sigmoid"
            seq = sequence_logp(forward_logprobs(policy.module, *inputs), inputs[3], mean=mean)
            ref_seq = sequence_logp(ref_logp, inputs[3], mean=mean)
            _, m = dpo_loss(seq[0::2], seq[1::2], None if kind == "simpo" else ref_seq[0::2],
                            None if kind == "simpo" else ref_seq[1::2], beta=0.1, kind=kind)
            assert got["eval/loss"] == pytest.approx(m["loss"], rel=1e-5, abs=1e-7), kind
            assert got["eval/rewards/accuracies"] == pytest.approx(m["rewards/accuracies"]), kind
            assert got["eval/rewards/margins"] == pytest.approx(m["rewards/margins"], rel=1e-4, abs=1e-6), kind
        got = evaluate(PairUpdate(rm.module, tok, 64, torch.device("cpu")), held, {"loss": "bradley_terry"})
        scores = pair_scores(rm.module, pairs)
        _, m = bradley_terry_loss(scores[0::2], scores[1::2])
        assert got == pytest.approx({"eval_accuracy": m["accuracy"], "eval_loss": m["loss"]}, rel=1e-5)
        demos = rows_batch([{"prompt": r["prompt"], "response": r["response"]} for r in rows])
        whole = token_rows(demos, tok, 64)
        value, _ = sft_micro_loss(policy.module, whole, num_tokens=float(whole["response_mask"].sum()))
        assert evaluate(job, demos, {"loss": "sft"})["eval/sft_loss"] == pytest.approx(float(value), rel=1e-5)


def test_the_references_held_out_forward_is_micro_batched() -> None:
    """The controller runs the reference over the held-out rows once with these attrs: never all rows at once."""
    assert held_out_forward({"micro_batch": 0, "share_prefix": True}) == {"micro_batch": EVAL_ROWS,
                                                                          "share_prefix": True}
    assert held_out_forward({}) == {"micro_batch": EVAL_ROWS}
    assert held_out_forward({"micro_batch": 6}) == {"micro_batch": 6}


PEAK = """
import gc, json, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from flowrl.models.tokenizer import CharTokenizer
from flowrl.runtime.preference_update import EVAL_REF, PairUpdate, evaluate, rows_batch

n, loss = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
torch.set_num_threads(1)  # no thread pool growing mid-measurement
tok = CharTokenizer("0123456789+=")
# an 8k vocabulary: every response position's logits are 32 KB in fp32, what bounds an evaluation's memory
module = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                    bos_token_id=None, eos_token_id=None)).eval()
job = PairUpdate(module, tok, 32, torch.device("cpu"))
rows = [{"prompt": f"{i % 10}+{i % 7}=", **({"response": str(i % 10 + i % 7)} if loss == "sft" else
                                             {"chosen": str(i % 10 + i % 7), "rejected": str(i % 10 + i % 7 + 1)})}
        for i in range(n)]
attrs = {"loss": loss, "beta": 0.1, EVAL_REF: torch.zeros(2 * n, 3)}  # no micro_batch: the default bound
def status(key):  # kB, the kernel's count
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

def reset_peak():  # VmHWM back to the current RSS (proc(5), clear_refs "5"): a peak of this phase alone
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

gc.collect()
reset_peak()
start = status("VmRSS")
warm = rows[:128]  # a micro-batch or two first: the forward's own buffers
evaluate(job, rows_batch(warm), {**attrs, EVAL_REF: torch.zeros(2 * len(warm), 3)})
warm_peak = status("VmHWM")
gc.collect()
reset_peak()
before = status("VmRSS")
metrics = evaluate(job, rows_batch(rows), attrs)
after = status("VmHWM")
print(json.dumps({"warm_rise_mb": (warm_peak - start) / 1024, "peak_rise_mb": (after - before) / 1024,
                  "metrics": metrics}))
"""


def _peak_rise(rows: int, loss: str) -> float:
    """The evaluation's peak resident memory above the RSS before it, in MB, in a fresh process (the kernel's VmHWM,
    reset before each phase: ru_maxrss cannot be, and in the full suite the start-up's peak hid the warm-up's rise),
    after a warm-up evaluation of 128 rows whose own rise shows the measurement sees a micro-batch."""
    # glibc's mmap threshold fixed (it otherwise rises after a large free, moving later large blocks onto a heap
    # that fragments): freed logits go back to the system, so the peak is what the evaluation held, not the
    # allocator's cache
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", PEAK, str(rows), loss], capture_output=True, text=True, cwd=ROOT,
                         timeout=1200, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(v == v for v in result["metrics"].values())  # finite numbers came out
    # a micro-batch's logits are seen: 32 sequences (16 pairs) x at least 2 response positions x 32 KB = 2 MB (the
    # forward computes the response positions' log-probs; measured 5.0 MB)
    assert result["warm_rise_mb"] >= 2.0, result
    return float(result["peak_rise_mb"])


@pytest.mark.parametrize("loss", ["dpo", "sft"])
def test_held_out_memory_is_flat_in_the_held_out_sets_size(loss: str) -> None:
    """200 and 20,000 held-out rows on an 8k-vocabulary model: the same peak (one bounded forward's logits, seen in
    the warm-up), where one forward over every row (main's evaluation) holds all their logits at once (measured on
    main with this script: 200 rows +33 MB, 2,000 rows +822 MB; 20,000 rows would be ~9 GB)."""
    small, large = _peak_rise(200, loss), _peak_rise(20_000, loss)
    assert large <= small + 16.0, (small, large)
