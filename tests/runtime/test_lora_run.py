"""LoRA runs end to end (flowrl.models.lora, flowrl.runtime.lora_state, flowrl.runtime.export): a GRPO run whose policy
trains adapters and whose reference is its base resumes with the metrics of a run straight through, its checkpoints
hold the adapters and the base's digest (a different base is an error, not a different model), share-prefix gives the
numbers of the plain forwards, and `flowrl export` writes the adapters merged into the base (transformers, without
flowrl, gives flowrl's logits) or as a peft adapter directory (`PeftModel.from_pretrained` gives them too)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import flowrl
from flowrl import cli
from flowrl.errors import FlowError
from flowrl.runtime.worker import ModelWorker
from tests.models.hf_elsewhere import load_elsewhere
from tests.runtime.test_run import strip_times

FLOW = """flow lora
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, lr = 2e-2,
                        lora_rank = 4, lora_alpha = 8{actor} }}
model ref : reference {{ source = actor }}
reward digits = "digits.reward"
data prompts = jsonl("data.jsonl") {{ batch = 4 }}
use grpo(reward = digits, group = 4, max_tokens = 3, kl_coef = 0.05)
run {{ steps = 4, seed = 2, checkpoint_every = 2 }}
"""
IDS = [[1, 80, 108, 101, 97, 115, 101, 32, 97, 100, 100, 58, 32, 49, 43, 50, 61]]  # <bos>, bytes + 3


def write(folder: Path, actor: str = "") -> Path:
    """The flow, a reward that differs within a group from the first step, and prompts of 19 bytes (share-prefix
    runs each one's prefix once: its samples share it)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"Please add: {a}+{b}=", "answer": a + b} for a in range(4) for b in range(4)]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "digits.py").write_text("def reward(prompt, response, **_):\n"
                                      "    return float(sum(c.isdigit() for c in response))\n")
    (folder / "f.flow").write_text(FLOW.format(actor=actor))
    return folder / "f.flow"


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("lora")
    flow = write(folder)
    graph = flowrl.load(str(flow))
    result = flowrl.run(graph, out_dir=folder / "run")
    return {"flow": flow, "graph": graph, "run": folder / "run", "metrics": result.metrics}


def trained_policy(flow: Path, run_dir: Path) -> torch.nn.Module:
    """The policy as a worker holds it after loading the run's last checkpoint (its adapters on the rebuilt base)."""
    graph = flowrl.load(str(flow))
    worker = ModelWorker(graph.models, graph.models, seed=2)
    state = torch.load(sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1], weights_only=False)
    worker.load_state_dict(state["groups"]["colocated"])
    return worker.models["actor"].module


def test_a_lora_run_trains_the_adapters_and_resumes_exactly(straight: dict[str, Any], tmp_path: Path) -> None:
    rows = straight["metrics"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["actor/grad_norm"] > 0 for r in rows)
    assert rows[-1]["kl_mean"] > 0  # the policy moved away from its base, which the reference still is
    part = tmp_path / "part"
    flowrl.run(straight["graph"], out_dir=part, steps=2)
    resumed = flowrl.run(straight["graph"], out_dir=part, resume=True).metrics
    assert strip_times(resumed) == strip_times(rows)


def test_the_checkpoint_holds_the_adapters_and_the_bases_digest(straight: dict[str, Any]) -> None:
    state = torch.load(straight["run"] / "checkpoints" / "step_000004.pt", weights_only=False)["groups"]["colocated"]
    actor = state["actor"]
    assert actor["module"] and all(".lora_A." in k or ".lora_B." in k for k in actor["module"])
    assert set(actor["optim"]["module"]) == set(actor["module"]) and isinstance(actor["base"], str)
    assert state["ref"]["module"] == {} and state["ref"]["optim"] is None


def test_adapters_on_another_base_are_an_error(straight: dict[str, Any], tmp_path: Path) -> None:
    state = torch.load(straight["run"] / "checkpoints" / "step_000004.pt", weights_only=False)
    state["groups"]["colocated"]["actor"]["base"] = "0" * 32
    graph = straight["graph"]
    worker = ModelWorker(graph.models, graph.models, seed=2)
    rebuilt = worker.state_dict()["actor"]["base"]
    with pytest.raises(FlowError) as info:
        worker.load_state_dict(state["groups"]["colocated"])
    assert info.value.render() == (
        f"error: the adapters of `actor` were trained on other base weights than the ones rebuilt here (digest "
        f"{'0' * 32}, rebuilt {rebuilt})\n"
        "hint: the base is rebuilt from the model's source and the run's seed: the `hf:` directory (or the torch "
        "version that initialised a tiny model) must be the one the run started with")


def test_share_prefix_gives_the_plain_forwards_numbers(straight: dict[str, Any], tmp_path: Path) -> None:
    graph = straight["graph"]
    assert next(n for n in graph.nodes if n.id == "ref_logp").attrs.get("share_prefix") is True
    plain = flowrl.run(flowrl.load(str(straight["flow"]), no_pass=["share-prefix"]), out_dir=tmp_path / "plain",
                       steps=2).metrics
    for a, b in zip(plain, straight["metrics"][:2], strict=True):
        for key in ("reward_mean", "kl_mean", "actor/pg_loss", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_export_merges_the_adapters_into_the_base(straight: dict[str, Any], tmp_path: Path) -> None:
    assert cli.main(["export", str(straight["run"]), "-o", str(tmp_path / "hf")]) == 0
    there = load_elsewhere([{"dir": str(tmp_path / "hf"), "kind": "causal", "ids": IDS}], tmp_path / "elsewhere")[0]
    assert there["class"] == "GPT2LMHeadModel"
    policy = trained_policy(straight["flow"], straight["run"])
    with torch.no_grad():
        ours = policy(input_ids=torch.tensor(IDS)).logits.float()
    torch.testing.assert_close(there["logits"], ours, rtol=0, atol=1e-5)


def test_export_adapter_writes_a_peft_directory(straight: dict[str, Any], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "adapter"
    assert cli.main(["export", str(straight["run"]), "-o", str(out), "--adapter"]) == 0
    said = capsys.readouterr()
    assert said.out == f"wrote {out}: `actor` (step 4) as LoRA adapter (peft), float32\n"
    assert said.err == f"note: the base the adapters go on is {out / 'base'} (GPT2LMHeadModel)\n"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                                     "base"]
    base = AutoModelForCausalLM.from_pretrained(out / "base")
    model = PeftModel.from_pretrained(base, out).eval()
    policy = trained_policy(straight["flow"], straight["run"])
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(IDS)).logits
        ours = policy(input_ids=torch.tensor(IDS)).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(out / "base")  # where its base is
