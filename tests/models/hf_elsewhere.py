"""Loads exported Hugging Face directories the way a user of them would: a fresh Python with transformers and torch,
flowrl made unimportable (a finder refuses it, so a config or tokenizer that needed flowrl's code would fail here)
and checked absent at the end. Run as `python hf_elsewhere.py JOBS.json OUT.pt` (tests/models/test_export.py and
tests/runtime/test_export_run.py); writes each job's results, in order, with torch.save.

`load_elsewhere(jobs, folder)` runs it from a test. A job: {"dir": DIR, "kind": "causal" | "classifier", "ids": [[...]] (rows of one length), "texts": [...] (strings
to encode), "prompts": [...] and "max_new_tokens": M (causal: greedy answers through `model.generate`)}.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


class _NoFlowrl(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "flowrl" or name.startswith("flowrl."):
            raise ImportError(f"{name} is not importable here: the export must load without flowrl")
        return None


def load_elsewhere(jobs: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """Each job's results from a fresh Python that cannot import flowrl (run in `folder`, PYTHONPATH unset)."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    spec, out = folder / "jobs.json", folder / "results.pt"
    spec.write_text(json.dumps(jobs), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, __file__, str(spec), str(out)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results: list[dict[str, Any]] = torch.load(out, weights_only=False)
    return results


def run(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    path = job["dir"]
    tok = AutoTokenizer.from_pretrained(path)
    auto: Any = AutoModelForSequenceClassification if job["kind"] == "classifier" else AutoModelForCausalLM
    model = auto.from_pretrained(path).eval()
    out: dict[str, Any] = {
        "class": type(model).__name__, "dtype": str(model.dtype).removeprefix("torch."),
        "tokenizer_class": type(tok).__name__, "config": AutoConfig.from_pretrained(path).to_dict(),
        "specials": {k: (getattr(tok, f"{k}_token"), getattr(tok, f"{k}_token_id")) for k in ("bos", "eos", "pad")},
        "encoded": [tok.encode(t, add_special_tokens=False) for t in job.get("texts", [])],
        "with_specials": [tok(t)["input_ids"] for t in job.get("texts", [])],
        "decoded": [tok.decode(ids, skip_special_tokens=True) for ids in job.get("decode", [])],
    }
    with torch.no_grad():
        if job.get("ids"):
            out["logits"] = model(torch.tensor(job["ids"])).logits.float()
        if job.get("prompts"):
            enc = tok(job["prompts"], return_tensors="pt", padding=True, padding_side="left")
            gen = model.generate(**enc, do_sample=False, max_new_tokens=job["max_new_tokens"])
            answers = []
            for row in gen[:, enc["input_ids"].shape[1]:].tolist():
                eos = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
                answers.append(row[:eos])  # what follows EOS is generate's padding
            out["answers"] = answers
            out["answer_texts"] = [tok.decode(a, skip_special_tokens=True) for a in answers]
            out["prompt_ids"] = [[i for i, m in zip(r, mk, strict=True) if m] for r, mk in
                                 zip(enc["input_ids"].tolist(), enc["attention_mask"].tolist(), strict=True)]
    return out


def main() -> None:
    sys.meta_path.insert(0, _NoFlowrl())
    import torch

    jobs = json.loads(open(sys.argv[1], encoding="utf-8").read())
    results = [run(job) for job in jobs]
    assert not [m for m in sys.modules if m == "flowrl" or m.startswith("flowrl.")], "flowrl was imported"
    torch.save(results, sys.argv[2])


if __name__ == "__main__":
    main()
