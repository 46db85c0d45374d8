"""docs/architecture.md's picture keeps up with the code: every backend registered and every module it names."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import flowrl
from flowrl import backends

ROOT = Path(__file__).resolve().parents[1]


def _picture_source() -> str:
    spec = importlib.util.spec_from_file_location("architecture", ROOT / "docs" / "architecture.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["architecture"] = module
    spec.loader.exec_module(module)
    return str(module.draw().source)


def test_the_picture_shows_every_backend_and_names_real_modules() -> None:
    source = _picture_source()
    for name in backends.names():
        assert f"backends/{name}" in source
    named = set(re.findall(r"\b(?:flowrl|runtime)\.([a-z_]+)", source))
    assert named, "the picture names no module"
    for module in sorted(named):
        if module in flowrl.__all__:  # a function of the package (`flowrl.run`)
            continue
        try:
            importlib.import_module(f"flowrl.runtime.{module}")
        except ModuleNotFoundError:
            importlib.import_module(f"flowrl.{module}")  # fails for a module that is gone or renamed


def test_the_architecture_page_links_its_picture() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert "img/architecture.svg" in page and (ROOT / "docs" / "img" / "architecture.svg").exists()
