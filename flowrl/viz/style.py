"""Colours, shapes and labels shared by every `flowrl viz` view and by `flowrl timeline`.

One palette keyed by role (and by the controller-side ops) so a model looks the same in the parsed,
optimized and placed views; one colour per op for the timeline's bars.
"""

from __future__ import annotations

import html
import textwrap
from dataclasses import dataclass

from flowrl.ir.graph import Graph, Node


@dataclass(frozen=True)
class Swatch:
    fill: str  # node background
    line: str  # border, and the cluster tint's edge


# Model calls take their model's role; controller-side nodes take their op; "controller" is the single
# controller's own node in the placed view.
PALETTE: dict[str, Swatch] = {
    "policy": Swatch("#d0e4ff", "#2f6db5"),
    "reference": Swatch("#e6dcf7", "#6f4bb0"),
    "critic": Swatch("#d3f0dc", "#2e8b57"),
    "reward_model": Swatch("#ffe8b3", "#b7791f"),
    "data": Swatch("#e9ecef", "#6c757d"),
    "reward": Swatch("#fde2cf", "#c2571a"),
    "fn": Swatch("#fce4ec", "#ad1457"),
    "controller": Swatch("#495057", "#212529"),
}

# Bar colours of the timeline, one per op (stronger than the node fills: bars are small).
OP_COLORS: dict[str, str] = {
    "data": "#868e96",
    "generate": "#1c7ed6",
    "logprobs": "#74c0fc",
    "values": "#40c057",
    "score": "#fab005",
    "reward": "#e8590c",
    "fn": "#d6336c",
    "update": "#5f3dc4",
    "instance": "#66d9e8",  # a serverless / simulated generation instance's lifetime
    "sync": "#495057",  # a weight sync between groups
    "eval": "#12b886",  # a held-out evaluation between steps (`eval NAME { }`): its generation, then its scoring
}
OTHER_OP_COLOR = "#adb5bd"

SHAPES: dict[str, tuple[str, str]] = {  # op -> (shape, extra style)
    "data": ("cylinder", ""),
    "generate": ("box", "rounded"),
    "logprobs": ("box", "rounded"),
    "values": ("box", "rounded"),
    "score": ("box", "rounded"),
    "reward": ("box", ""),
    "fn": ("box", ""),
    "update": ("box", "rounded,bold"),
}

FONT = "Helvetica"
GRAPH_ATTR = {
    "rankdir": "LR", "fontname": FONT, "fontsize": "12", "nodesep": "0.35", "ranksep": "0.55",
    "labelloc": "t", "labeljust": "l", "newrank": "true", "pad": "0.2", "outputorder": "edgesfirst",
}
NODE_ATTR = {"fontname": FONT, "fontsize": "11", "margin": "0.12,0.06", "penwidth": "1.2"}
EDGE_ATTR = {"fontname": FONT, "fontsize": "9", "color": "#868e96", "fontcolor": "#495057",
             "arrowsize": "0.7", "labelfloat": "false"}

SHARED_PREFIX = "\u2750 shared prefix"  # ❐ (in DejaVu Sans, unlike ⧉, so PNGs show it too)


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def wrap(text: str, width: int = 60) -> list[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False) or [""]


def role_of(g: Graph, n: Node) -> str:
    """The palette key of a node: its model's role for model calls, its op otherwise."""
    if n.model is not None:
        try:
            return g.model(n.model).role
        except KeyError:
            return "policy"
    return n.op if n.op in PALETTE else "fn"


def call_text(g: Graph, n: Node) -> str:
    """What the node calls, as written: `actor.generate`, `fn: group_advantage`, `reward: correct`."""
    if n.op == "data":
        decl = next((d for d in g.data if d.name == n.id), None)
        if decl is None:
            return "data"
        return f"{decl.kind}({decl.path.rsplit('/', 1)[-1]})"
    if n.op == "reward":
        target = str(n.attrs.get("fn", ""))
        reward = next((r for r in g.rewards if target in (r.target, r.name)), None)
        return f"reward: {reward.name if reward else target.rsplit('.', 1)[-1]}"
    if n.op == "fn":
        return f"fn: {n.attrs.get('fn', '?')}"
    if n.op == "update":
        loss = n.attrs.get("loss")
        return f"update \u00b7 {loss}" if loss else "update"
    return f"{n.model}.{n.method or n.op}"


def detail_text(g: Graph, n: Node) -> str | None:
    """One short line of the most telling literal arguments, or None."""
    if n.op == "data":
        decl = next((d for d in g.data if d.name == n.id), None)
        return f"batch {decl.options['batch']}" if decl and "batch" in decl.options else None
    if n.op == "generate":
        parts = [f"{k}={n.attrs[k]}" for k in ("n", "max_tokens") if k in n.attrs]
        return ", ".join(parts) or None
    return None


def node_label(g: Graph, n: Node, extra: list[str] | None = None, font_color: str | None = None,
               order: int | None = None) -> str:
    """An HTML-like label: the node id in bold, then the call, then any extra lines (smaller). A table, not
    <BR/>s, so an underscore in the id (`old_logp`) keeps clear of the line below it."""
    color = f' COLOR="{font_color}"' if font_color else ""
    lines = [f"<B>{esc(n.id)}</B>"]
    if order is not None:  # the position in the controller's schedule (placed view)
        lines[0] = f'<FONT POINT-SIZE="9">{order}.</FONT> ' + lines[0]
    call = call_text(g, n)
    if call != n.id:
        lines.append(f'<FONT POINT-SIZE="9">{esc(call)}</FONT>')
    detail = detail_text(g, n)
    if detail:
        lines.append(f'<FONT POINT-SIZE="8">{esc(detail)}</FONT>')
    lines += [f'<FONT POINT-SIZE="9">{esc(line)}</FONT>' for line in extra or []]
    rows = "".join(f"<TR><TD><FONT{color}>{line}</FONT></TD></TR>" for line in lines)
    return f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="1">{rows}</TABLE>>'


def node_attrs(g: Graph, n: Node) -> dict[str, str]:
    swatch = PALETTE[role_of(g, n)]
    shape, extra = SHAPES.get(n.op, ("box", ""))
    style = ",".join(s for s in ("filled", extra) if s)
    return {"shape": shape, "style": style, "fillcolor": swatch.fill, "color": swatch.line}


HEAT_STOPS = (0.01, 0.1, 0.25, 0.5, 1.0)  # the shares the timings key shows


def heat(share: float) -> str:
    """White (0% of the step) to red (100%). On a square-root scale: linear left every node under ~20% of
    the step looking white, and those are the ones worth telling apart."""
    s = min(max(share, 0.0), 1.0) ** 0.5
    lo, hi = (255, 255, 255), (201, 42, 42)
    r, gr, b = (round(a + (c - a) * s) for a, c in zip(lo, hi, strict=True))
    return f"#{r:02x}{gr:02x}{b:02x}"


def seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def percent(share: float) -> str:
    return "<1%" if 0 < share < 0.01 else f"{share:.0%}"


def table(title: str, rows: list[tuple[str, str]], tail: str = "", width: int = 72) -> str:
    """The caption of a view: a bold title, then a framed legend of `key | text` rows (text wrapped) and
    any ready-made `tail` rows."""
    cells = []
    for key, text in rows:
        body = "<BR/>".join(esc(line) for line in wrap(text, width))
        cells.append(f'<TR><TD ALIGN="LEFT" VALIGN="TOP"><B>{esc(key)}</B></TD>'
                     f'<TD ALIGN="LEFT" BALIGN="LEFT">{body}</TD></TR>')
    legend = ('<TABLE BORDER="1" STYLE="ROUNDED" COLOR="#ced4da" CELLBORDER="0" CELLSPACING="1" '
              'CELLPADDING="3">' + "".join(cells) + tail + "</TABLE>")
    return ('<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="3">'
            f'<TR><TD ALIGN="LEFT"><FONT POINT-SIZE="14"><B>{esc(title)}</B></FONT></TD></TR>'
            f'<TR><TD ALIGN="LEFT"><FONT POINT-SIZE="9">{legend}</FONT></TD></TR></TABLE>>')
