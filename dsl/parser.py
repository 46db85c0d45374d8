"""Flow text -> `dsl.ast.Module`: the first stage of the front end (lowering comes next, in `dsl.lower`).

The grammar lives in `grammar.lark` (LALR, contextual lexer, positions propagated; the parser is built
once and cached). Lark's errors never escape: each becomes a `Diagnostic` with a named message chosen by
`match_examples` from the table in `dsl/syntax_errors.py`, or a generic "unexpected X, expected Y".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from flowrl.errors import Diagnostic, FlowError

from . import ast
from .diagnostics import Source
from .syntax_errors import describe_error

_GRAMMAR = Path(__file__).with_name("grammar.lark")
MAX_LIST_DEPTH = 32


@functools.lru_cache(maxsize=1)
def lark_parser() -> Lark:
    """The LALR parser, built once per process (and cached on disk by Lark across processes)."""
    return Lark(
        _GRAMMAR.read_text(encoding="utf-8"),
        parser="lalr",
        lexer="contextual",
        propagate_positions=True,
        start=["start", "value_only"],
        cache=True,
    )


def _raw_parse(text: str, start: str = "start") -> Tree[Token]:
    return lark_parser().parse(text, start=start)


def parse(text: str, path: str = "<string>") -> ast.Module:
    """Parse a whole flow file; raises FlowError with every syntax problem found."""
    src = Source(path, text)
    tree = _parse_tree(src, "start")
    builder = _Builder(src)
    decls = tuple(builder.decl(child) for child in tree.children if isinstance(child, Tree))
    builder.check_separated(decls, "declarations must be on separate lines")
    if builder.problems:
        raise FlowError(builder.problems)
    return ast.Module(path, text, decls)


def parse_value(src: Source) -> ast.Expr:
    """Parse `src.text` as a single value (a literal, name, list or range): used for `--set` overrides."""
    tree = _parse_tree(src, "value_only")
    builder = _Builder(src)
    value = builder.value(tree.children[0])
    if builder.problems:
        raise FlowError(builder.problems)
    return value


def _parse_tree(src: Source, start: str) -> Tree[Token]:
    try:
        return _raw_parse(src.text, start)
    except UnexpectedInput as e:
        diag = _syntax_diagnostic(src, e, start)
    except LarkError as e:  # anything else Lark may raise is still a syntax error, never a traceback
        diag = Diagnostic(f"syntax error: {e}", src.loc(ast.Span(1, 1, 1, 2)), source_line=src.line(1))
    raise FlowError(diag)


def _syntax_diagnostic(src: Source, e: UnexpectedInput, start: str) -> Diagnostic:
    if isinstance(e, (UnexpectedToken, UnexpectedCharacters)):
        # the table's examples are whole flows: they only say something about errors in whole flows
        return describe_error(src, e, _raw_parse if start == "start" else None)
    return src.error_at(f"syntax error: {e}", max(e.line, 1), max(e.column, 1))


def _span(node: Tree[Token] | Token) -> ast.Span:
    if isinstance(node, Token):
        return ast.Span(node.line or 1, node.column or 1, node.end_line or 1, node.end_column or 1,
                        node.start_pos or 0, node.end_pos or 0)
    m = node.meta
    if m.empty:
        return ast.Span(1, 1, 1, 2)
    return ast.Span(m.line, m.column, m.end_line, m.end_column, m.start_pos, m.end_pos)


_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t"}


class _Builder:
    """Lark tree -> AST; collects the problems the grammar lets through (bad escapes, missing separators)."""

    def __init__(self, src: Source) -> None:
        self.src = src
        self.problems: list[Diagnostic] = []

    # ---- leaves ---------------------------------------------------------------------------------

    def ident(self, tok: Tree[Token] | Token | None) -> ast.Ident:
        assert isinstance(tok, Token)
        return ast.Ident(str(tok), _span(tok))

    def maybe_ident(self, tok: Tree[Token] | Token | None) -> ast.Ident | None:
        return None if tok is None else self.ident(tok)

    def string(self, tok: Token) -> ast.Literal:
        body, out, i = str(tok)[1:-1], [], 0
        while i < len(body):
            ch = body[i]
            if ch == "\\" and i + 1 < len(body):
                nxt = body[i + 1]
                if nxt in _ESCAPES:
                    out.append(_ESCAPES[nxt])
                else:
                    col = (tok.column or 1) + 1 + i
                    self.problems.append(self.src.error_at(
                        f"syntax error: unknown escape '\\{nxt}' in string", tok.line or 1, col, 2,
                        hint='escapes are \\" \\\\ \\n \\t; write \\\\ for a backslash'))
                    out.append(nxt)
                i += 2
            else:
                out.append(ch)
                i += 1
        return ast.Literal("".join(out), _span(tok))

    def value(self, node: Tree[Token] | Token | None, depth: int = 0) -> ast.Expr:
        assert isinstance(node, Tree)
        kind, kids, span = node.data, node.children, _span(node)
        if depth > MAX_LIST_DEPTH:  # keeps every later walk over values far from Python's recursion limit
            self.problems.append(self.src.error(f"syntax error: lists nest more than {MAX_LIST_DEPTH} deep", span))
            return ast.ListLit((), span)
        tok = kids[0] if kids else None
        if kind == "int_lit" and isinstance(tok, Token):
            return ast.Literal(int(tok), span)
        if kind == "float_lit" and isinstance(tok, Token):
            return ast.Literal(float(tok), span)
        if kind == "str_lit" and isinstance(tok, Token):
            return self.string(tok)
        if kind in ("true_lit", "false_lit"):
            return ast.Literal(kind == "true_lit", span)
        if kind == "name_ref" and isinstance(tok, Token):
            return ast.Name(str(tok), span)
        if kind == "range_lit":
            lo, hi = (int(k) for k in kids if isinstance(k, Token))
            return ast.RangeLit(lo, hi, span)
        assert kind == "list_lit", kind
        return ast.ListLit(tuple(self.value(k, depth + 1) for k in kids), span)

    # ---- composite pieces -----------------------------------------------------------------------

    def block(self, node: Tree[Token] | Token | None) -> tuple[ast.Entry, ...]:
        if node is None:
            return ()
        assert isinstance(node, Tree)
        entries = []
        for e in node.children:
            assert isinstance(e, Tree)
            entries.append(ast.Entry(self.ident(e.children[0]), self.value(e.children[1]), _span(e)))
        self.check_separated(entries, "missing ',' or newline between entries", comma_ok=True)
        return tuple(entries)

    def args(self, nodes: Sequence[Tree[Token] | Token]) -> tuple[ast.Arg, ...]:
        out = []
        for a in nodes:
            assert isinstance(a, Tree)
            if a.data == "kwarg":
                out.append(ast.Arg(self.ident(a.children[0]), self.value(a.children[1]), _span(a)))
            else:
                out.append(ast.Arg(None, self.value(a.children[0]), _span(a)))
        return tuple(out)

    def call(self, node: Tree[Token] | Token) -> ast.Call:
        assert isinstance(node, Tree)
        kids = node.children
        callee = self.ident(kids[0])
        method = self.ident(kids[1]) if len(kids) > 1 and isinstance(kids[1], Token) else None
        rest = kids[2:] if method else kids[1:]
        return ast.Call(callee, method, self.args(rest), _span(node))

    def stmts(self, nodes: Sequence[Tree[Token] | Token]) -> tuple[ast.Stmt, ...]:
        out = []
        for s in nodes:
            assert isinstance(s, Tree)
            if s.data == "bind_stmt":
                out.append(ast.Stmt(self.ident(s.children[0]), self.call(s.children[1]), _span(s)))
            else:
                out.append(ast.Stmt(None, self.call(s.children[0]), _span(s)))
        self.check_separated(out, "statements must be on separate lines")
        return tuple(out)

    def check_separated(self, items: list[ast.Entry] | list[ast.Stmt] | tuple[ast.Decl, ...], message: str,
                        comma_ok: bool = False) -> None:
        """Consecutive items need a newline (or, in `{ }` entries, a comma) between them."""
        for prev, nxt in zip(items, items[1:], strict=False):
            gap = self.src.text[prev.span.end_pos:nxt.span.start_pos]
            if "\n" in gap or (comma_ok and "," in gap):
                continue
            hint = "separate them with ',' or put each on its own line" if comma_ok else "start a new line"
            self.problems.append(self.src.error(f"syntax error: {message}", nxt.span, hint=hint))

    # ---- declarations ---------------------------------------------------------------------------

    def decl(self, node: Tree[Token]) -> ast.Decl:
        kind, span = node.data, _span(node)
        kids = node.children[1:]  # children[0] is the keyword token
        if kind == "flow_decl":
            return ast.FlowDecl(self.ident(kids[0]), span)
        if kind == "import_decl":
            assert isinstance(kids[0], Token)
            return ast.ImportDecl(self.string(kids[0]), span)
        if kind == "model_decl":
            return ast.ModelDecl(self.ident(kids[0]), self.ident(kids[1]),
                                 self.block(kids[2] if len(kids) > 2 else None), span)
        if kind == "reward_decl":
            source = kids[1]
            block = self.block(kids[2] if len(kids) > 2 else None)
            if isinstance(source, Tree):  # reward_call: KIND("address")
                kind_tok, address = source.children
                assert isinstance(address, Token)
                return ast.RewardDecl(self.ident(kids[0]), self.string(address), span, self.ident(kind_tok), block)
            assert isinstance(source, Token)
            return ast.RewardDecl(self.ident(kids[0]), self.string(source), span, None, block)
        if kind == "data_decl":
            has_block = bool(kids) and isinstance(kids[-1], Tree) and kids[-1].data == "block"
            args = kids[2:-1] if has_block else kids[2:]
            return ast.DataDecl(self.ident(kids[0]), self.ident(kids[1]), self.args(args),
                                self.block(kids[-1] if has_block else None), span)
        if kind == "use_decl":
            return ast.UseDecl(self.ident(kids[0]), self.args(kids[1:]), span)
        if kind == "step_decl":
            return ast.StepDecl(self.stmts(kids), span)
        if kind == "template_decl":
            params = [k for k in kids[1:] if isinstance(k, Tree) and k.data == "tparam"]
            body = [k for k in kids[1:] if isinstance(k, Tree) and k.data != "tparam"]
            return ast.TemplateDecl(self.ident(kids[0]), tuple(self.tparam(p) for p in params),
                                    self.stmts(body), span)
        if kind == "run_decl":
            return ast.RunDecl(self.block(kids[0]), span)
        if kind == "env_decl":
            target = kids[1]
            assert isinstance(target, Token)
            return ast.EnvDecl(self.ident(node.children[0]), self.ident(kids[0]), self.string(target),
                               self.block(kids[2] if len(kids) > 2 else None), span)
        if kind == "eval_decl":
            return ast.EvalDecl(self.ident(kids[0]), self.block(kids[1]), span)
        if kind == "stage_decl":
            # a stage's parts may share a line (`stage rm { use reward_model(...)  run { steps = 60 } }`)
            items = [self.decl(k) for k in kids[1:] if isinstance(k, Tree)]
            assert all(isinstance(i, (ast.UseDecl, ast.StepDecl, ast.RunDecl, ast.PlacementDecl, ast.EvalDecl))
                       for i in items)
            return ast.StageDecl(self.ident(kids[0]), tuple(items), span)  # type: ignore[arg-type]
        assert kind == "placement_decl", kind
        pools, assigns = [], []
        for item in kids:
            assert isinstance(item, Tree)
            if item.data == "pool_decl":
                rest = item.children[1:]
                pools.append(ast.PoolDecl(self.ident(rest[0]), self.block(rest[1] if len(rest) > 1 else None),
                                          _span(item)))
            else:
                targets = tuple(self.target(t) for t in item.children[:-1])
                assigns.append(ast.Assign(targets, self.ident(item.children[-1]), _span(item)))
        return ast.PlacementDecl(tuple(pools), tuple(assigns), span)

    def tparam(self, node: Tree[Token]) -> ast.TemplateParam:
        name, role, default = node.children
        return ast.TemplateParam(self.ident(name), self.maybe_ident(role),
                                 None if default is None else self.value(default), _span(node))

    def target(self, node: Tree[Token] | Token) -> ast.Target:
        assert isinstance(node, Tree)
        kids = node.children
        return ast.Target(self.ident(kids[0]), self.ident(kids[1]) if len(kids) > 1 else None, _span(node))
