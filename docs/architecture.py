"""Draws docs/img/architecture.svg (`python docs/architecture.py`): the layers of flowrl and the path of one
`flowrl run`, with the project's own graphviz styling (flowrl.viz.style). tests/test_docs.py checks that it
names every backend registered and every package the import rules know, so the picture keeps up with the code."""

from __future__ import annotations

import sys
from pathlib import Path

import graphviz

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowrl import backends  # noqa: E402
from flowrl.viz import style  # noqa: E402

# (layer, [(node id, label)]) from the top layer down; imports only go down.
LAYERS: list[tuple[str, list[tuple[str, str]]]] = [
    ("command line", [("cli", "flowrl.cli\\ncheck compile run viz timeline")]),
    ("compile · draw", [("compiler", "flowrl.compiler\\ncompile_file"), ("viz", "flowrl.viz\\nviews, timeline")]),
    ("backends/ (where a plan runs)", [(f"be_{n}", f"backends/{n}") for n in backends.names()]),
    ("runtime: the single controller", [("runner", "runtime.runner\\nrun: steps, metrics,\\ncheckpoints, trace"),
                                        ("controller", "runtime.controller\\nController.step"),
                                        ("fusion", "runtime.fusion\\nfused stages"),
                                        ("geninfer", "runtime.gen_infer\\nstreamed generation"),
                                        ("scoring", "runtime.scoring\\nreward workers, http")]),
    ("runtime: the backend contract", [("protocol", "runtime.protocol\\nWorkerGroup, Backend"),
                                       ("dispatch", "runtime.dispatch\\nplan → ranks → merge"),
                                       ("worker", "runtime.worker\\nModelWorker (one per rank)")]),
    ("language · passes", [("dsl", "flowrl.dsl\\nparse, check, lower"), ("passes", "flowrl.passes\\nGraph → Graph")]),
    ("engines · rewards · data", [("engines", "flowrl.engines\\ngeneration, forward,\\ntraining, prefix"),
                                  ("rewards", "flowrl.rewards\\nverifiable, http"), ("data", "flowrl.data")]),
    ("core", [("ir", "flowrl.ir\\nGraph, Node, GroupDecl"), ("algos", "flowrl.algos\\nlosses, advantages"),
              ("models", "flowrl.models\\nHF models, tokenizers"), ("errors", "flowrl.errors")]),
]

# The path of `flowrl run FLOW --backend B`, in order.
PATH: list[tuple[str, str, str]] = [
    ("cli", "compiler", "1 compile_file"),
    ("compiler", "dsl", "2 parse + lower → Graph"),
    ("compiler", "passes", "3 run_passes"),
    ("cli", "runner", "4 flowrl.run(graph, backend=B)"),
    ("runner", f"be_{backends.names()[0]}", "5 backends.make(B).start → groups"),
    ("runner", "controller", "6 step loop"),
    ("controller", "fusion", "7 fused stage"),
    ("fusion", "geninfer", "8 stream chunks"),
    ("controller", "dispatch", "9 group.call(method)"),
    ("dispatch", "worker", "10 per rank"),
    ("worker", "engines", "11 generate / forward / update"),
    ("controller", "scoring", "12 rewards"),
]


def draw() -> graphviz.Digraph:
    dot = graphviz.Digraph("architecture", graph_attr={**style.GRAPH_ATTR, "rankdir": "TB", "ranksep": "0.4"})
    swatch = style.PALETTE["policy"]
    for i, (title, nodes) in enumerate(LAYERS):
        with dot.subgraph(name=f"cluster_{i}") as c:
            c.attr(label=title, style="rounded,filled", fillcolor="#f8f9fa", color="#ced4da", fontname=style.FONT,
                   rank="same")
            for node, label in nodes:
                c.node(node, label, shape="box", style="rounded,filled", fillcolor=swatch.fill, color=swatch.line,
                       fontname=style.FONT, fontsize="10")
        if i:  # one layer under the other (invisible edges only order them)
            dot.edge(LAYERS[i - 1][1][0][0], nodes[0][0], style="invis", weight="10")
    for a, b, label in PATH:
        dot.edge(a, b, label=label, fontname=style.FONT, fontsize="9", color="#c2571a", fontcolor="#c2571a")
    for name in backends.names():  # every backend implements the protocol and runs ModelWorkers on its ranks
        dot.edge(f"be_{name}", "protocol", style="dashed", color="#868e96", arrowhead="empty")
    return dot


def main() -> None:
    out = ROOT / "docs" / "img" / "architecture"
    draw().render(out, format="svg", cleanup=True)
    print(f"wrote {out}.svg")


if __name__ == "__main__":
    main()
