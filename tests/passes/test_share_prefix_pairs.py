"""Pass share-prefix on preference pairs (issue 27 item 6): an update on pairs from a data node (dpo,
bradley_terry) and the forwards over that data are marked, each refusal has its case, and a second run of the
pass changes nothing. (That the marked graph computes the same numbers is tests/runtime/test_preference_update.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import flowrl
from flowrl.ir.graph import Graph
from flowrl.passes.share_prefix import MIN_LEN, share_prompt_prefix

FLOW = """\
model actor : policy {{ source = "tiny:gpt2" }}
model ref : reference {{ source = actor }}
model rm : reward_model {{ source = actor }}
data pairs = jsonl("pairs.jsonl") {{ batch = 4 }}
data demos = jsonl("demos.jsonl") {{ batch = 4 }}
step {{
{body}
}}
"""
DPO = """    ref_logp = ref.logprobs(pairs)
    rm.update(pairs, loss = "bradley_terry")
    actor.update(pairs, loss = "dpo", ref_logp = ref_logp)"""


def _graph(tmp_path: Path, prompt: str, body: str = DPO) -> Graph:
    rows = [{"prompt": f"{prompt}{i}+1=", "chosen": str(i + 1), "rejected": "0", "response": str(i + 1)}
            for i in range(4)]
    for name in ("pairs", "demos"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp_path / "t.flow").write_text(FLOW.format(body=body), encoding="utf-8")
    return flowrl.load(str(tmp_path / "t.flow"), passes=False)


def _marked(g: Graph) -> set[str]:
    return {n.id for n in g.nodes if n.attrs.get("share_prefix")}


def test_marks_the_pair_updates_and_the_forwards_over_their_data(tmp_path: Path) -> None:
    g, notes = share_prompt_prefix(_graph(tmp_path, "please add these two numbers: "))
    assert _marked(g) == {"ref_logp", "rm.update", "actor.update"}
    assert all(g.node(n).attrs["prefix_min_len"] == MIN_LEN for n in _marked(g))
    assert notes == ["pairs: chosen and rejected share each pair's prompt: computed once in ref_logp, rm.update, "
                     "actor.update"]
    again, _ = share_prompt_prefix(g)
    assert again.nodes == g.nodes  # idempotent


def test_refuses_prompts_shorter_than_the_minimum(tmp_path: Path) -> None:
    g, notes = share_prompt_prefix(_graph(tmp_path, ""))
    assert _marked(g) == set()
    assert notes == [f"pairs: not shared: every prompt in `pairs` is at most 5 tokens, under prefix_min_len = {MIN_LEN}"]


def test_leaves_sft_on_demonstrations_alone(tmp_path: Path) -> None:
    # one row per prompt: nothing repeats within a demonstration batch
    g, notes = share_prompt_prefix(_graph(tmp_path, "please add these two numbers: ",
                                          body='    actor.update(demos, loss = "sft")'))
    assert _marked(g) == set() and notes == []
