"""The reference tables a user reads agree with the code: docs/language.md's key tables list every key of
flowrl.ir.signatures' declaration tables with its default, and the README's command-line table names only verbs
and options the `flowrl` command has, and every verb it has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flowrl import cli
from flowrl.ir import signatures as sig

ROOT = Path(__file__).resolve().parents[1]
LANGUAGE = (ROOT / "docs" / "language.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(text: str, start: str, stop: str) -> str:
    begin = text.index(start)
    return text[begin:text.index(stop, begin)]


def _defaults(section: str) -> dict[str, str]:
    """Key -> the default cell's first backticked value (or the cell) of each `| key | kind | default |` row;
    a row naming several keys (`layers`, `dim`, `heads`) pairs them with its defaults in order, or gives each the
    one default it has."""
    out: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        keys = re.findall(r"`(\w+)`", cells[0])
        values = re.findall(r"`([^`]+)`", cells[2]) or [cells[2]]
        out.update(zip(keys, values if len(values) == len(keys) else [values[0]] * len(keys), strict=True))
    return out


def _written(value: object) -> str | float:
    """A default as the flow language writes it; numbers compared as numbers."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    assert isinstance(value, (int, float))
    return float(value)


TABLES = [
    ("model", sig.MODEL_KEYS, ("### `model`", "### `reward`")),
    ("data", sig.DATA_KEYS, ("### `data`", "### `run`")),
    ("run", sig.RUN_KEYS, ("### `run`", "### `eval`")),
    ("eval", sig.EVAL_KEYS, ("### `eval`", "## The iteration")),
    ("reward", sig.REWARD_KEYS, ("### `reward`", "`code_tests` takes")),
    ("env", sig.ENV_KEYS, ("## Environments and tools", "Any other key")),
]


@pytest.mark.parametrize(("block", "keys", "bounds"), TABLES, ids=[t[0] for t in TABLES])
def test_the_language_reference_lists_every_key_with_its_default(
        block: str, keys: dict[str, tuple[str, object]], bounds: tuple[str, str]) -> None:
    documented = _defaults(_section(LANGUAGE, *bounds))
    assert not sorted(set(keys) - set(documented)), f"docs/language.md's {block} table lacks keys"
    for key, (_, default) in keys.items():
        if default is None or isinstance(default, tuple):  # required, by role, or none: said in words
            continue
        want = _written(default)
        got: str | float = float(documented[key]) if isinstance(want, float) else documented[key]
        assert got == want, f"{block} key `{key}`: the docs say {documented[key]}, signatures.py {default!r}"


def _cli_rows() -> list[tuple[str, set[str]]]:
    """(verb, options) for each row of the README's command-line table."""
    table = _section(README, "## The command line", "**Backends**")
    rows = []
    for line in table.splitlines():
        m = re.match(r"\| `flowrl ([a-z-]+)([^`]*)`", line)
        if m:
            rows.append((m.group(1), set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", m.group(2)))))
    return rows


def _options(verb: str, capsys: pytest.CaptureFixture[str]) -> set[str]:
    with pytest.raises(SystemExit):
        cli.main([verb, "--help"])
    return set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", capsys.readouterr().out))


def test_the_readme_command_table_matches_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _cli_rows()
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    verbs = set(re.findall(r"^    ([a-z-]+)", capsys.readouterr().out, flags=re.MULTILINE))
    assert {verb for verb, _ in rows} == verbs
    assert sum(len(options) for _, options in rows) > 20  # the table's options were read
    for verb, options in rows:
        assert not sorted(options - _options(verb, capsys)), f"README: `flowrl {verb}` has no such option"
