"""The lexical and syntactic layer: named syntax errors (full messages), contextual keywords, separators,
literals, positions."""

from __future__ import annotations

from collections.abc import Callable
from textwrap import dedent

import pytest
from lark.exceptions import UnexpectedInput

from flowrl.dsl import ast, parse
from flowrl.dsl.parser import _raw_parse
from flowrl.dsl.syntax_errors import EXAMPLES, LABELS, _match
from flowrl.errors import FlowError
from flowrl.ir.graph import Range

Check = Callable[..., str]


def expect(text: str) -> str:
    return dedent(text).strip("\n")


def syntax_error(text: str) -> str:
    with pytest.raises(FlowError) as info:
        parse(text, "t.flow")
    return info.value.render()


SYNTAX = [
    ("step {\n    rollout = actor.generate(prompts)\n", """
        t.flow:1:6: error: syntax error: unbalanced brace: '{' is never closed
            step {
                 ^
        hint: add a matching '}'
    """),
    ("step {\n    rollout = actor.generate(prompts)\n\nrun { steps = 1 }\n", """
        t.flow:1:6: error: syntax error: unbalanced brace: '{' is never closed
            step {
                 ^
        hint: add '}' before `run` on line 4
    """),
    ('model actor : policy { source = "tiny:gpt2"\n\nstep { }\n', """
        t.flow:1:22: error: syntax error: unbalanced brace: '{' is never closed
            model actor : policy { source = "tiny:gpt2"
                                 ^
        hint: add '}' before `step` on line 3
    """),
    ("step { }\n}\n", """
        t.flow:2:1: error: syntax error: unbalanced brace: '}' has no matching '{'
            }
            ^
        hint: remove it, or add the missing '{'
    """),
    ("model actor : policy { lr 1e-4 }\n", """
        t.flow:1:26: error: syntax error: missing '=' after `lr`
            model actor : policy { lr 1e-4 }
                                     ^
        hint: write `KEY = VALUE`
    """),
    ("step {\n    rollout actor.generate(prompts)\n}\n", """
        t.flow:2:12: error: syntax error: missing '=' after `rollout`
                rollout actor.generate(prompts)
                       ^
        hint: a statement is `NAME = CALL(...)` or `MODEL.update(...)`
    """),
    ("run { steps = }\n", """
        t.flow:1:14: error: syntax error: missing value after '='
            run { steps = }
                         ^
        hint: a value is a number, a "string", true/false, a name, a list or a range such as 2..16
    """),
    ("step {\n    rollout = actor.generate(prompts) @\n}\n", """
        t.flow:2:39: error: syntax error: unknown character '@'
                rollout = actor.generate(prompts) @
                                                  ^
    """),
    ("step {\n    rollout = actor.generate(prompts);\n}\n", """
        t.flow:2:38: error: syntax error: unknown character ';'
                rollout = actor.generate(prompts);
                                                 ^
    """),
    ('reward r = "flowrl.rewards.arith_exact\n', """
        t.flow:1:12: error: syntax error: unterminated string
            reward r = "flowrl.rewards.arith_exact
                       ^
        hint: close it with '"' on the same line
    """),
    ("use grpo(group = 8\nrun { steps = 1 }\n", """
        t.flow:1:19: error: syntax error: missing ')'
            use grpo(group = 8
                              ^
        hint: close the argument list with ')' (arguments are separated by ',')
    """),
    ("step {\n    rollout = actor.generate(prompts\n}\n", """
        t.flow:2:37: error: syntax error: missing ')'
                rollout = actor.generate(prompts
                                                ^
        hint: close the argument list with ')' (arguments are separated by ',')
    """),
    ("step {\n    adv = gae(scores values)\n}\n", """
        t.flow:2:21: error: syntax error: missing ',' before `values`
                adv = gae(scores values)
                                ^
        hint: separate arguments and list items with ','
    """),
    ("run { steps = [1, 2 }\n", """
        t.flow:1:20: error: syntax error: missing ']'
            run { steps = [1, 2 }
                               ^
        hint: close the list with ']' (items are separated by ',')
    """),
    ("step {\n    adv = gae(correct(rollout))\n}\n", """
        t.flow:2:22: error: syntax error: a call cannot be an argument
                adv = gae(correct(rollout))
                                 ^
        hint: bind the inner call to a name on its own line, then pass that name
    """),
    ("modle actor : policy { }\n", """
        t.flow:1:1: error: syntax error: expected a declaration, got `modle`
            modle actor : policy { }
            ^^^^^
        hint: did you mean `model`?
    """),
    ("rollout = actor.generate(prompts)\n", """
        t.flow:1:1: error: syntax error: expected a declaration, got `rollout`
            rollout = actor.generate(prompts)
            ^^^^^^^
        hint: a flow is made of `flow`, `import`, `model`, `reward`, `data`, `use`, `step`, `template`, `run` and `placement` declarations; statements go inside `step { }`
    """),
    ('model actor { source = "tiny:gpt2" }\n', """
        t.flow:1:12: error: syntax error: missing ': ROLE' after the model name
            model actor { source = "tiny:gpt2" }
                       ^
        hint: write `model NAME : ROLE { ... }` with ROLE one of policy, reference, critic, reward_model
    """),
    ("run { steps = 1 seed = 2 }\n", """
        t.flow:1:17: error: syntax error: missing ',' or newline between entries
            run { steps = 1 seed = 2 }
                            ^^^^^^^^
        hint: separate them with ',' or put each on its own line
    """),
    ("step {\n    a = f(x) b = g(a)\n}\n", """
        t.flow:2:14: error: syntax error: statements must be on separate lines
                a = f(x) b = g(a)
                         ^^^^^^^^
        hint: start a new line
    """),
    ('reward r = "a\\qb"\n', """
        t.flow:1:14: error: syntax error: unknown escape '\\q' in string
            reward r = "a\\qb"
                         ^^
        hint: escapes are \\" \\\\ \\n \\t; write \\\\ for a backslash
    """),
    ("step {\n    x = actor.generate.more(prompts)\n}\n", """
        t.flow:2:23: error: syntax error: unexpected '.', expected '('
                x = actor.generate.more(prompts)
                                  ^
    """),
    ("flow\n", """
        t.flow:1:5: error: syntax error: expected a name after `flow`, got end of file
            flow
                ^
    """),
]


@pytest.mark.parametrize("text, expected", SYNTAX)
def test_syntax_error(text: str, expected: str) -> None:
    assert syntax_error(text) == expect(expected)


def test_every_table_example_is_named_by_its_own_label() -> None:
    for label, examples in EXAMPLES.items():
        assert label in LABELS
        for bad in examples:
            with pytest.raises(UnexpectedInput) as info:
                _raw_parse(bad)
            assert _match(info.value, _raw_parse) == label, bad


def test_syntax_errors_through_compile_and_load(compile_error: Check) -> None:
    assert compile_error("step {\n").startswith("t.flow:1:6: error: syntax error: unbalanced brace")


# ---- keywords are reserved only where a declaration or statement begins ------------------------------


def test_keywords_as_names_keys_parameters_and_arguments() -> None:
    text = dedent("""\
        model pool : policy { source = "tiny:gpt2" }
        reward reward = "flowrl.rewards.arith_exact"
        data data = jsonl("x.jsonl") { model = 1, step = 2, run = 3, flow = 4 }
        template t(model: policy, reward, data, use = 1, template = true) {
            run = model.generate(data, n = use, placement = template)
            import = reward(run)
        }
        use t(model = pool, reward = reward, data = data)
    """)
    m = parse(text, "t.flow")
    model, rew, data, tmpl, use = m.decls
    assert isinstance(model, ast.ModelDecl) and model.name.name == "pool"
    assert isinstance(rew, ast.RewardDecl) and rew.name.name == "reward"
    assert isinstance(data, ast.DataDecl) and [e.key.name for e in data.entries] == ["model", "step", "run", "flow"]
    assert isinstance(tmpl, ast.TemplateDecl)
    assert [p.name.name for p in tmpl.params] == ["model", "reward", "data", "use", "template"]
    assert [s.target.name for s in tmpl.body if s.target] == ["run", "import"]
    assert isinstance(use, ast.UseDecl) and [a.key.name for a in use.args if a.key] == ["model", "reward", "data"]


def test_keyword_prefixes_are_names() -> None:
    m = parse("step {\n    models = runner.stepper(datas, flag = true_ish, other = false)\n}\n", "t.flow")
    stmt = m.decls[0].body[0]  # type: ignore[union-attr]
    assert stmt.target.name == "models" and stmt.call.callee.name == "runner"
    assert stmt.call.method.name == "stepper"
    assert [a.value for a in stmt.call.args] == [
        ast.Name("datas", a.value.span) if i == 0 else a.value for i, a in enumerate(stmt.call.args)]
    assert isinstance(stmt.call.args[1].value, ast.Name) and stmt.call.args[1].value.name == "true_ish"
    assert isinstance(stmt.call.args[2].value, ast.Literal) and stmt.call.args[2].value.value is False


def test_keywords_in_a_compiled_flow(compile_ok: Callable[..., object]) -> None:
    # the standard templates take `reward`; a reward may itself be called `reward`, a model `pool`
    g = compile_ok(dedent("""\
        model pool : policy { source = "tiny:gpt2" }
        model ref : reference { source = pool }
        reward reward = "flowrl.rewards.arith_exact"
        data prompts = jsonl("data/arith.jsonl")
        use grpo(actor = pool, max_tokens = 8)
    """))
    assert [n.id for n in g.nodes][-1] == "pool.update"  # type: ignore[attr-defined]


# ---- comments, separators, literals -----------------------------------------------------------------


def _entries(block: str) -> dict[str, object]:
    m = parse(f"run {block}\n", "t.flow")
    run = m.decls[0]
    assert isinstance(run, ast.RunDecl)
    out: dict[str, object] = {}
    for e in run.entries:
        v = e.value
        out[e.key.name] = (v.value if isinstance(v, ast.Literal) else
                           (v.lo, v.hi) if isinstance(v, ast.RangeLit) else
                           v.name if isinstance(v, ast.Name) else v)
    return out


@pytest.mark.parametrize("block", [
    "{ a = 1, b = 2 }",
    "{\n    a = 1\n    b = 2\n}",
    "{ a = 1,\n  b = 2, }",
    "{  # comment after the brace\n    a = 1   # trailing comment\n    # a comment line\n    b = 2\n}",
    "{ a = 1\n, b = 2 }",
])
def test_entries_separated_by_commas_or_newlines(block: str) -> None:
    assert _entries(block) == {"a": 1, "b": 2}


def test_literals() -> None:
    assert _entries('{ i = 8, n = -3, p = +2, f = 0.2, e = 1e-5, E = 2E3, g = -1.5e+2 }') == {
        "i": 8, "n": -3, "p": 2, "f": 0.2, "e": 1e-5, "E": 2000.0, "g": -150.0}
    assert _entries('{ t = true, f = false, a = auto, s = "x # not a comment" }') == {
        "t": True, "f": False, "a": "auto", "s": "x # not a comment"}
    assert _entries('{ s = "a\\"b\\\\c\\nd\\te", empty = "" }') == {"s": 'a"b\\c\nd\te', "empty": ""}
    assert _entries("{ r = 2..16, one = 1..1 }") == {"r": (2, 16), "one": (1, 1)}


def test_lists() -> None:
    m = parse('run { l = [1, 2.5, "x", [true], name,], e = [] }\n', "t.flow")
    entries = m.decls[0].entries  # type: ignore[union-attr]
    lst = entries[0].value
    assert isinstance(lst, ast.ListLit) and len(lst.items) == 5
    assert [type(i).__name__ for i in lst.items] == ["Literal", "Literal", "Literal", "ListLit", "Name"]
    assert entries[1].value == ast.ListLit((), entries[1].value.span)


def test_ranges_in_a_compiled_flow(compile_ok: Callable[..., object]) -> None:
    g = compile_ok(dedent("""\
        model actor : policy { source = "tiny:gpt2", replicas = 2..16 }
        step { }
        placement {
            pool p { gpus = 8..32, elastic = true }
            actor -> p
        }
    """))
    assert g.models[0].replicas == Range(2, 16)  # type: ignore[attr-defined]
    assert g.pools[0].gpus == Range(8, 32) and g.pools[0].elastic  # type: ignore[attr-defined]


def test_positions_on_every_node() -> None:
    m = parse('flow f\nstep {\n    x = m.generate(p, n = 2)\n}\n', "t.flow")
    stmt = m.decls[1].body[0]  # type: ignore[union-attr]
    assert (stmt.line, stmt.col, stmt.end_col) == (3, 5, 29)
    assert (stmt.target.line, stmt.target.col, stmt.target.end_col) == (3, 5, 6)
    assert (stmt.call.method.line, stmt.call.method.col, stmt.call.method.end_col) == (3, 11, 19)
    kw = stmt.call.args[1]
    assert (kw.key.col, kw.value.col, kw.value.end_col) == (23, 27, 28)
    assert (m.decls[0].line, m.decls[0].col) == (1, 1)


def test_multi_line_statement_text_is_folded(compile_ok: Callable[..., object]) -> None:
    g = compile_ok(dedent("""\
        model actor : policy { source = "tiny:gpt2" }
        data prompts = jsonl("data/arith.jsonl")
        step {
            rollout = actor.generate(prompts,   # the prompts
                                     n = 2)
        }
    """))
    assert g.node("rollout").text == "rollout = actor.generate(prompts, n = 2)"  # type: ignore[attr-defined]
