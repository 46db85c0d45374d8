"""Named syntax errors: Lark's `match_examples` maps a parse failure to the closest bad input below.

Each label has a message, a hint and where the caret goes: at the offending token, just after the token
before it (for "missing X"), or at the bracket that is never closed. A parser error the table does not
know becomes "unexpected X, expected Y". Lexer errors (no token matches) are named by their character
instead: `"` starts an unterminated string, anything else is an unknown character (a lexer error carries
no token, so `match_examples` can only compare parser states, which says nothing about the character).
Used only by `dsl.parser`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from flowrl.errors import Diagnostic

from .ast import strip_comment
from .diagnostics import Source, did_you_mean

DECL_KEYWORDS = ("flow", "import", "model", "reward", "data", "use", "step", "template", "run", "placement", "env",
                 "tool", "stage", "eval")


@dataclass(frozen=True)
class Label:
    message: str  # a format string: {prev} is the token before the error, {tok} the offending one
    hint: str | None  # used as written
    where: str  # "token" | "after" | "opener"


LABELS: dict[str, Label] = {
    "unclosed_brace": Label("unbalanced brace: '{{' is never closed", "add a matching '}'", "opener"),
    "extra_brace": Label("unbalanced brace: '}}' has no matching '{{'", "remove it, or add the missing '{'",
                         "token"),
    "missing_rparen": Label("missing ')'", "close the argument list with ')' (arguments are separated by ',')",
                            "after"),
    "missing_rbracket": Label("missing ']'", "close the list with ']' (items are separated by ',')", "after"),
    # not in the table: a missing ')' or ']' whose next token is a value on the same line
    "missing_comma": Label("missing ',' before {tok}", "separate arguments and list items with ','", "after"),
    "missing_equals": Label("missing '=' after `{prev}`", "write `KEY = VALUE`", "after"),
    "missing_bind_equals": Label(
        "missing '=' after `{prev}`", "a statement is `NAME = CALL(...)` or `MODEL.update(...)`", "after"),
    "missing_value": Label("missing value after '='",
                           "a value is a number, a \"string\", true/false, a name, a list or a range such as 2..16",
                           "after"),
    "missing_role": Label("missing ': ROLE' after the model name",
                          "write `model NAME : ROLE { ... }` with ROLE one of policy, reference, critic, "
                          "reward_model", "after"),
    "missing_name": Label("expected a name after `{prev}`, got {tok}", None, "token"),
    "expected_call": Label("expected a call after '=', got {tok}",
                           "write `NAME = FUNCTION(...)` or `NAME = MODEL.METHOD(...)`", "token"),
    "nested_call": Label("a call cannot be an argument",
                         "bind the inner call to a name on its own line, then pass that name", "token"),
    "expected_decl": Label("expected a declaration, got {tok}",
                           "a flow is made of `flow`, `import`, `model`, `reward`, `data`, `use`, `step`, "
                           "`template`, `run` and `placement` declarations; statements go inside `step { }`",
                           "token"),
    "expected_stage_item": Label("expected `use`, `step`, `run` or `placement` in a stage, got {tok}",
                                 "a stage holds one `use` or `step { }`, and its own `run { }` and `placement { }`; "
                                 "models, data and rewards are declared at the top level, for every stage",
                                 "token"),
    "unterminated_string": Label("unterminated string", "close it with '\"' on the same line", "token"),
    "unknown_char": Label("unknown character {tok}", None, "token"),
}

EXAMPLES: dict[str, list[str]] = {
    "expected_decl": ["x", "x = f(a)", "actor.update(x)", "1", "\"s\"", "{", "step { } x", "run { } x"],
    "unclosed_brace": [
        "step {", "step { x = f(a)", "run {", "run { steps = 1", "run { steps = 1,",
        "model a : policy {", "model a : policy { lr = 1", "data d = jsonl(\"x\") { batch = 1",
        "placement {", "placement { pool p { gpus = 1 }", "placement { pool p { gpus = 1 }",
        "placement { pool p { gpus = 1", "placement { a -> p", "template t() {", "template t() { x = f(a)",
    ],
    "extra_brace": [
        "}", "step { } }", "run { } }", "model a : policy { } }", "step { x = f(a) } }",
        "model a : policy { lr = 1 } }", "data d = jsonl(\"x\") { } }", "placement { } }",
    ],
    "missing_rparen": [
        "use g(a", "use g(a = 1", "use g(a = 1 b", "use g(a = 1 }", "use g(a = 1 run",
        "step { x = f(a", "step { x = f(a }", "step { x = f(a y", "step { x = f(k = 1",
        "step { x = f(k = 1 }", "step { x = f(k = 1 y", "step { x = m.f(a", "step { x = m.f(a }",
        "step { m.update(a", "step { m.update(a }", "data d = jsonl(\"x\"", "data d = jsonl(\"x\" {",
        "template t(a", "template t(a {", "template t(a = 1 {", "template t(a: policy {",
    ],
    "missing_rbracket": ["run { a = [1", "run { a = [1 }", "run { a = [1 b", "use g(a = [1)", "run { a = [1, 2 }",
                         "use g(a = [1, 2)", "run { a = [x }", "run { a = [x, y }"],
    "missing_equals": [
        "run { steps 1", "run { steps \"x\"", "model a : policy { lr 1 }", "run { steps = 1, seed 0",
        "reward r \"x\"", "data d jsonl", "use g(a = 1, b 2)", "step { x = f(k = 1, b 2) }",
    ],
    "missing_bind_equals": ["step { x f(a) }", "step { x }", "step { x = f(a)\n y }"],
    "missing_value": [
        "run { steps = }", "run { steps = ,", "use g(a = )", "use g(a = ,", "step { x = f(k = ) }",
        "step { x = f(a, k = ) }", "reward r =", "model a : policy { lr = }", "template t(a = ) {",
    ],
    "missing_role": ["model a {", "model a policy", "model a"],
    # a declaration word where a stage's part goes; each also after a declaration (the parser's stack is one deeper)
    # and after a part (the lexer names a keyword it cannot take there as that keyword, so each word is listed)
    "expected_stage_item": [f"{first}stage s {{ {part}{word}" for first in ("", "flow f\n")
                            for part in ("", "use g() ", "step { } ", "run { } ")
                            for word in ("x", "model", "data d", "reward r", "import", "template", "env", "tool",
                                         "flow", "stage")],
    "missing_name": [
        "model : policy", "model {", "reward = \"x\"", "data = jsonl", "use (", "flow", "flow {",
        "template (", "placement { pool {", "stage {",
    ],
    "expected_call": ["step { x = 1 }", "step { x = \"s\" }", "step { x = y }", "step { x = y\n}"],
    "nested_call": ["step { x = f(g(a)) }", "step { x = f(a, g(b)) }", "step { x = f(k = g(b)) }",
                    "use g(a = f(x))"],
}

_VALUE_TOKENS = ("NAME", "INT", "FLOAT", "STRING", "TRUE", "FALSE", "LSQB")
_NAMES = {
    "NAME": "a name", "INT": "an integer", "FLOAT": "a number", "STRING": "a string", "LBRACE": "'{'",
    "RBRACE": "'}'", "LPAR": "'('", "RPAR": "')'", "LSQB": "'['", "RSQB": "']'", "COMMA": "','",
    "EQUAL": "'='", "COLON": "':'", "DOT": "'.'", "$END": "end of file", "TRUE": "`true`", "FALSE": "`false`",
    "_ARROW": "'->'", "_DOTDOT": "'..'",
}


def _terminal(name: str) -> str:
    if name in _NAMES:
        return _NAMES[name]
    if name.lower() in DECL_KEYWORDS or name == "POOL":
        return f"`{name.lower()}`"
    return f"'{name.lower()}'"


def _token_text(tok: Any) -> str:
    if tok.type == "$END":
        return "end of file"
    if tok.type == "NAME" or tok.type.lower() in DECL_KEYWORDS:
        return f"`{tok}`"
    if tok.type == "STRING":
        return f"string {tok}"
    return f"'{tok}'"


def _line_col(text: str, pos: int) -> tuple[int, int]:
    pos = max(0, min(pos, len(text)))
    return text.count("\n", 0, pos) + 1, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _end_of_previous(text: str, pos: int) -> int:
    """Offset just past the last non-blank, non-comment character before `pos` (0 when there is none)."""
    start = pos
    while start > 0:
        line_start = text.rfind("\n", 0, start) + 1
        code = strip_comment(text[line_start:start]).rstrip()
        if code:
            return line_start + len(code)
        start = line_start - 1
    return 0


def _previous_word(text: str, pos: int) -> tuple[str, int]:
    end = _end_of_previous(text, pos)
    begin = end
    while begin > 0 and (text[begin - 1].isalnum() or text[begin - 1] == "_"):
        begin -= 1
    return text[begin:end], begin


def _unclosed(text: str, upto: int, opener: str = "{([") -> tuple[str, int] | None:
    """The innermost bracket opened before `upto` and not closed by then (strings and comments skipped)."""
    stack: list[tuple[str, int]] = []
    pairs = {"}": "{", ")": "(", "]": "["}
    i, in_string = 0, False
    while i < upto:
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 1
            elif ch in '"\n':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "#":
            nl = text.find("\n", i)
            i = upto if nl < 0 else nl
            continue
        elif ch in "{([":
            stack.append((ch, i))
        elif ch in pairs and stack and stack[-1][0] == pairs[ch]:
            stack.pop()
        i += 1
    for ch, at in reversed(stack):
        if ch in opener:
            return ch, at
    return None


def describe_error(src: Source, e: UnexpectedToken | UnexpectedCharacters,
                   parse_fn: Callable[[str], Any] | None) -> Diagnostic:
    """The diagnostic for a Lark parse failure: a named error from the table (matched by parsing its
    examples with `parse_fn`; None skips the table), or a generic one."""
    text = src.text
    if isinstance(e, UnexpectedToken):
        tok = e.token
        # the end of the file is shown just after its last token, not on a trailing empty line
        pos = _end_of_previous(text, len(text)) if tok.type == "$END" else (tok.start_pos or 0)
        tok_text = _token_text(tok)
        width = max(len(str(tok)), 1) if tok.type != "$END" else 1
    else:
        pos, tok_text, width = e.pos_in_stream or 0, f"'{e.char}'", 1
    prev_word, prev_at = _previous_word(text, pos)

    # A declaration keyword at the start of a line, where a statement or entry was expected, means the
    # block before it was never closed (inside `{ }` the keyword lexes as a plain name).
    opened = _unclosed(text, prev_at, "{")
    line_start = text.rfind("\n", 0, prev_at) + 1
    if (prev_word in DECL_KEYWORDS and opened and not text[line_start:prev_at].strip()
            and isinstance(e, UnexpectedToken)):
        line, col = _line_col(text, opened[1])
        kw_line, _ = _line_col(text, prev_at)
        return src.error_at("syntax error: unbalanced brace: '{' is never closed", line, col,
                            hint=f"add '}}' before `{prev_word}` on line {kw_line}")

    label: str | None
    still_open = _unclosed(text, pos)
    if isinstance(e, UnexpectedCharacters):
        label = "unterminated_string" if e.char == '"' else "unknown_char"
    elif e.token.type == "$END" and still_open is not None:
        # at the end of the file, the innermost bracket still open says what is missing
        label = {"{": "unclosed_brace", "(": "missing_rparen", "[": "missing_rbracket"}[still_open[0]]
    else:
        label = _match(e, parse_fn) if parse_fn is not None else None
    if label is None:
        assert isinstance(e, UnexpectedToken)
        expected = sorted({_terminal(t) for t in e.accepts or e.expected})
        line, col = _line_col(text, pos)
        # a misspelt keyword (`modle`, `rnu`) lexes as a name: suggest the keyword it is closest to
        keywords = [t.strip("`") for t in expected if t.startswith("`") and t.strip("`").isidentifier()]
        near = did_you_mean(str(e.token), keywords) if e.token.type == "NAME" else None
        return src.error_at(f"syntax error: unexpected {tok_text}, expected {', '.join(expected)}", line, col,
                            width, hint=near)

    if (label in ("missing_rparen", "missing_rbracket") and isinstance(e, UnexpectedToken)
            and e.token.type in _VALUE_TOKENS and "\n" not in text[_end_of_previous(text, pos):pos]):
        label = "missing_comma"
    spec = LABELS[label]
    message = "syntax error: " + spec.message.format(prev=prev_word or "it", tok=tok_text)
    hint = spec.hint
    if label == "expected_decl" and isinstance(e, UnexpectedToken) and e.token.type == "NAME":
        hint = did_you_mean(str(e.token), DECL_KEYWORDS) or hint
    if spec.where == "after":
        line, col = _line_col(text, _end_of_previous(text, pos))
        return src.error_at(message, line, col, 1, hint=hint)
    if spec.where == "opener":
        opened = _unclosed(text, pos, "{")
        if opened is not None:
            line, col = _line_col(text, opened[1])
            return src.error_at(message, line, col, 1, hint=hint)
    line, col = _line_col(text, pos)
    return src.error_at(message, line, col, width, hint=hint)


def _match(e: UnexpectedInput, parse_fn: Callable[[str], Any]) -> str | None:
    try:
        label = e.match_examples(parse_fn, EXAMPLES, token_type_match_fallback=True, use_accepts=True)
    except Exception:  # an example that itself breaks Lark must not turn a syntax error into a crash
        return None
    return label if isinstance(label, str) else None
