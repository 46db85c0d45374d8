"""What `math_equal` compares (flowrl.rewards.math): a row's gold answer read whole, and the one answer a response
gives, both as math-verify parses them. Loaded by path into `math_equal`'s helper process, so it imports only the
standard library and math-verify.

**The gold answer.** A bare answer is LaTeX (MATH's convention: `(1, 2)`, `[0, 1)`, `1, 2, 3`, `y = 2x + 3`,
`3\\sqrt{2}`, `2^{10}`, `\\dfrac{3}{4}`, `\\$5`, `50\\%`) or a plain number (gsm8k's). It is read whole, as one
LaTeX expression (math-verify's reading of `$answer$`): math-verify's reading of the bare text finds the last
number in it, so `(1, 2)` was the number 2, and `\\boxed{2}` matched it while `\\boxed{(1, 2)}` did not. Exceptions:
- a gold that marks its own answer (an unescaped `$...$`, `\\boxed{}`) is read as math-verify reads it, and a
  gsm8k solution's text after its last `####` is its answer;
- a gold whose whole reading turns a plain word into a product of letters (`10 dollars` read as `10 a d o l l r s`:
  a run of three or more letters outside `\\text{}` and LaTeX commands, with letters left in the reading) keeps
  the plain reading (10); a text answer with no number (`Monday`) keeps its whole reading, as before.

**The response's answer** is one answer, never several tried in turn (a response must not hedge): a response with
`\\boxed{}` or LaTeX delimiters (`$`, `\\(`, `\\[`) is read as math-verify reads it (the last boxed answer first);
a plain-text response's answer is the math at the end of its last line (`The point is (1, 2).`,
`so y = 2x + 3`, `The roots are 1, 2, and 3`: `final_expression`), read whole; where there is none (`72 apples`,
`72. Hope this helps!`) math-verify's reading of the text (its last number) is the answer.

**Juxtaposed numbers and vanishing letters.** Two plain numbers side by side (`4 4`, `0 .5`, `12 3`) are not one
expression (latex2sympy reads them as a product, or `4 4` as 8): the answer is the last of them, as in `72 apples`.
Against a gold answer without variables, a response whose answer is made of letters that its value drops
(`we0d`, `0x`, `x - x`: a product with 0, letters that cancel) is not a number and scores 0, whatever it
simplifies to: otherwise any word with a 0 in it is right for the gold `0`.

**Equations.** An equation whose left side is one variable equals its right side (math-verify's rule, as the MATH
graders have it, since `y =` is routinely dropped): `2x + 3` is right for `y = 2x + 3`, and `x = 5` for `5`; a
different equation (`y = 2x`) or a part of it (`3`) is not.
"""

from __future__ import annotations

import re
from typing import Any

# where an answer says where its math is: an unescaped `$`, `\(`, `\[`, a `\boxed{}`/`\fbox{}`
DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed|\\fbox")
# groups of text inside LaTeX, whose words latex2sympy reads as text
TEXT_GROUP = re.compile(r"\\(?:text|textbf|textit|mbox|mathrm|operatorname)\s*\{[^{}]*\}")
COMMAND = re.compile(r"\\(?:begin|end)\{[A-Za-z]+\*?\}|\\[A-Za-z]+")  # `\\frac`, `\\begin{pmatrix}`
# a plain word: three or more letters not part of a LaTeX command's name
PROSE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")
# names of math a plain-text answer may spell out (`3*sqrt(2)`), and words joining the parts of a list
MATH_WORDS = frozenset("sqrt pi infty frac dfrac tfrac cdot times div pm mp cup cap leq geq neq circ log ln "
                       "sin cos tan cot sec csc exp".split())
JOINERS = frozenset({"and", "or"})
MATHY = re.compile(r"[\d()\[\]{}=+\-*/^\\<>|,%!]")
# a plain number: `4`, `-3`, `.5`, `1,000`, `7.` (not `1,` of a list)
NUMBER = re.compile(r"^[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)$")
RELATION = re.compile(r"^(?:=|<|>|\\in|\\le|\\ge|\\leq|\\geq|\\ne|\\neq)")


def final_expression(response: str) -> str | None:
    """The math at the end of `response`'s last line (`The point is (1, 2).` -> `(1, 2)`), or None.

    Tokens (split at whitespace) are taken from the line's end while they are math: a token with a digit, a
    bracket, an operator, a backslash, a lone letter, or a math name (`sqrt(2)`); a word of two or more letters
    ends the answer (`is`, `apples`) except `and`/`or` between parts (`1, 2, and 3`). A lone letter at the start
    is a word (`is a 5`) unless a relation follows it (`y = ...`, `x \\in ...`) or it is all there is (`C`).
    """
    lines = [line for line in response.splitlines() if line.strip()]
    if not lines:
        return None
    tokens = _tokens(lines[-1].strip().rstrip("."))
    span: list[str] = []
    for token in reversed(tokens):
        if not (_is_math(token) or (token.lower() in JOINERS and span)):
            break
        span.insert(0, token)
    for i in range(len(span) - 1, 0, -1):  # two plain numbers side by side: the answer is the last of them
        if NUMBER.match(span[i]) and NUMBER.match(span[i - 1].rstrip(".")):
            span = span[i:]
            break
    while len(span) > 1 and (span[0].lower() in JOINERS or
                             (len(span[0]) == 1 and span[0].isalpha() and not RELATION.match(span[1]))):
        span.pop(0)
    return " ".join(span) or None


def _tokens(line: str) -> list[str]:
    """`line` split at whitespace outside braces (`\\text{ cm}` is one token)."""
    tokens, depth, start = [], 0, None
    for i, ch in enumerate(line + " "):
        depth += (ch == "{") - (ch == "}")
        if ch.isspace() and depth <= 0:
            if start is not None:
                tokens.append(line[start:i])
            start, depth = None, 0
        elif start is None:
            start = i
    return tokens


def _is_math(token: str) -> bool:
    if len(token) == 1 and token.isalpha():
        return True  # a variable (a leading one may be a word: see `final_expression`)
    bare = COMMAND.sub(" ", TEXT_GROUP.sub(" ", token))  # a LaTeX command's name and `\\text{}`'s words are math
    for word in re.findall(r"[A-Za-z]+", bare):
        # `is`, `xy`, `apples` are words; `2x`, `2xy+1`, `10km` are math (latex2sympy drops units)
        if word.lower() not in MATH_WORDS and (len(word) > 2 or word == token):
            return False
    return bool(MATHY.search(token)) or token.lower() in MATH_WORDS


def _symbols(value: Any) -> bool:
    """Whether a parsed value has free symbols (letters read as variables)."""
    if isinstance(value, (tuple, list)):
        return any(_symbols(v) for v in value)
    return bool(getattr(value, "free_symbols", None))


def read_gold(answer: str, timeout: int) -> list[Any]:
    """The gold answer as math-verify values (see the module docstring); empty when it cannot be parsed."""
    from math_verify import parse

    text = answer.strip()
    if "####" in text:  # gsm8k's marker before a solution's final answer
        text = text.rsplit("####", 1)[1].strip()
    if DELIMITED.search(text):
        return list(parse(text, parsing_timeout=timeout))
    whole = list(parse(f"${text}$", parsing_timeout=timeout))
    if whole and not (PROSE.search(TEXT_GROUP.sub(" ", text)) and _symbols(whole[0])):
        return whole
    return list(parse(text, parsing_timeout=timeout)) or whole


def read_response(response: str, timeout: int) -> list[Any]:
    """The response's one answer as math-verify values (see the module docstring); empty when it has none."""
    from math_verify import parse

    if not DELIMITED.search(response):
        span = final_expression(response)
        if span:
            got = list(parse(f"${span}$", parsing_timeout=timeout))
            if any(not isinstance(value, str) for value in got):  # math-verify gives the text back when it fails
                return got
    return list(parse(response, parsing_timeout=timeout))


def grade(answer: str, response: str, timeout: int) -> float:
    """1.0 when the response's answer equals the gold answer, as math-verify's `verify` decides, else 0.0."""
    from math_verify import verify

    gold = read_gold(answer, timeout)
    got = read_response(response, timeout) if gold else []
    if not gold or not got:
        return 0.0
    if not _symbols(gold[0]) and _symbols(_value_side(got[0])):
        return 0.0  # letters in the answer to a number: `0x`, `x - x` (see the module docstring)
    return 1.0 if verify(gold, got, timeout_seconds=timeout) else 0.0


def _value_side(value: Any) -> Any:
    """What an answer says its value is: an equation's right side (`x = 5` is 5), else the answer itself."""
    rhs = getattr(value, "rhs", None)
    return rhs if rhs is not None and getattr(value, "lhs", None) is not None else value
