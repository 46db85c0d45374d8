"""The simulator's inputs: cluster specs, model shapes, workloads, a flow's work (flowrl.backends.sim)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.backends.sim.hardware import BUILTIN, load_cluster
from flowrl.backends.sim.shapes import KNOWN, from_hf_config, known, resolve
from flowrl.backends.sim.work import flow_work
from flowrl.backends.sim.workload import LongTail, replay, stretch, synthetic, tile
from flowrl.compiler import compile_file
from flowrl.errors import FlowError
from flowrl.ir.printer import to_json

ROOT = Path(__file__).resolve().parents[3]


def test_builtin_clusters_with_node_counts():
    assert {"h100", "a100-80g", "l40s"} <= set(BUILTIN)
    c = load_cluster("l40s:2")
    assert (c.devices, c.per_node, c.device.memory) == (16, 8, 48e9)
    assert c.money(3600.0) == pytest.approx(1.861)
    with pytest.raises(FlowError, match="no such built-in"):
        load_cluster("tpu:4")
    with pytest.raises(FlowError, match="positive integer"):
        load_cluster("h100:zero")


def test_cluster_from_toml(tmp_path: Path):
    path = tmp_path / "mine.toml"
    path.write_text('[device]\nname = "X"\nflops = 1e15\nmem_bw = 2e12\nmemory_gb = 96\n'
                    '[node]\ndevices = 4\nintra_bw = 1e11\ninter_bw = 1e10\n'
                    '[cluster]\nnodes = 3\nprice_device_hour = 2.0\n')
    c = load_cluster(str(path))
    assert (c.devices, c.device.memory, c.price_device_hour, c.link_bw(8)) == (12, 96e9, 2.0, 1e10)
    path.write_text('[device]\nflops = "fast"\n')
    with pytest.raises(FlowError, match="flops must be a number"):
        load_cluster(str(path))
    path.write_text("[device\n")
    with pytest.raises(FlowError, match="not valid TOML"):
        load_cluster(str(path))


def test_known_shapes_have_their_published_sizes():
    # parameter counts as the model cards give them (embeddings included), to 3%
    for name, billions in {"qwen2.5-3b": 3.09, "qwen2.5-7b": 7.62, "llama-2-7b": 6.74, "llama-2-13b": 13.0,
                           "llama-2-70b": 69.0, "llama-33b": 32.5, "llama-65b": 65.2}.items():
        assert known(name).params / 1e9 == pytest.approx(billions, rel=0.03), name
    assert known("Llama-2-70B") is KNOWN["llama-2-70b"]
    with pytest.raises(FlowError, match="no built-in model shape"):
        resolve("gpt-9")


def test_shape_from_an_hf_config_directory(tmp_path: Path):
    cfg = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
           "intermediate_size": 1024, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = resolve(str(tmp_path))
    assert (shape.layers, shape.kv_heads, shape.ffn) == (4, 2, 1024)
    assert shape.kv_bytes_per_token == 2 * 4 * 2 * 32 * 2
    gpt2 = from_hf_config({"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 50}, "g")
    assert not gpt2.gated and gpt2.tied and gpt2.ffn == 256


def test_synthetic_workload_is_long_tailed_capped_and_repeatable():
    tail = LongTail(prompts=64, samples=4, max_tokens=1024, median=200)
    steps = synthetic(tail, 6, seed=3)
    assert steps == synthetic(tail, 6, seed=3)
    lens = sorted(n for s in steps for w in s for n in w.responses)
    assert len(steps[0]) == 64 and all(len(w.responses) == 4 for w in steps[0])
    assert max(lens) <= 1024 and lens[len(lens) // 2] < 0.5 * lens[int(len(lens) * 0.99)]  # a long tail
    # prompts come back in a later epoch (dataset = 8 steps' worth by default: 4 steps of 128 here)
    ids = [w.prompt_id for s in synthetic(LongTail(prompts=8, dataset=16), 4) for w in s]
    assert len(set(ids)) == 16 and len(ids) == 32


def test_replay_tile_and_stretch(tmp_path: Path):
    rows = [{"step": 1, "node": "rollout", "prompt_id": [5, 9], "prompt_len": [3, 4], "response_len": [[1, 2], [3, 4]]}]
    (tmp_path / "lengths.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    [step] = replay(tmp_path)
    assert [(w.prompt_id, w.prompt_len, w.responses) for w in step] == [(5, 3, (1, 2)), (9, 4, (3, 4))]
    [big] = tile([step], 5)
    assert [w.prompt_id for w in big] == [5, 9, 15, 19, 25]
    assert stretch([step], 10, cap=25)[0][1].responses == (25, 25)
    (tmp_path / "lengths.jsonl").write_text('{"node": "rollout", "prompt_id": [1]}\n')
    with pytest.raises(FlowError, match=r"lengths.jsonl:1: not a lengths row"):
        replay(tmp_path)


def test_flow_work_reads_calls_fusion_and_shapes():
    g = to_json(compile_file(str(ROOT / "examples/longtail_ppo.flow")))
    w = flow_work(g, {"actor": known("llama-2-13b")}, prompts=64)
    assert w.generate.model == "actor" and w.prompts == 64 and w.samples == 4 and w.max_tokens == 64
    assert [f.node for f in w.forwards] == ["old_logp", "ref_logp", "values", "scores"]
    assert [tuple(u.node for u in c) for c in w.update_calls()] == [("actor.update", "critic.update")]
    # copies of the actor (ref, critic, rm: `source = actor`) take the shape it was given
    assert all(s is KNOWN["llama-2-13b"] for s in w.shapes.values())
    with pytest.raises(FlowError, match="no such model"):
        flow_work(g, {"policy": known("llama-2-13b")})
