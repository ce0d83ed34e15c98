"""What an adopter sees of the package: its version, its public API, its typing marker, its license."""

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rl_engine
from rl_engine import cli

ROOT = Path(__file__).resolve().parents[1]


def test_import_is_cheap():
    """`import rl_engine` loads neither torch nor Triton: each public name loads its module on first use."""
    code = "import sys, rl_engine; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_api_resolves():
    for name in rl_engine.__all__:
        assert getattr(rl_engine, name) is not None, name
    assert rl_engine.patch.__module__ == "rl_engine.integrations.transformers"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rl_engine.nope  # noqa: B018


def test_type_checkers_see_the_same_names():
    """The TYPE_CHECKING imports (what an IDE sees) name the same things, from the same modules, as _EXPORTS."""
    tree = ast.parse((ROOT / "rl_engine" / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {alias.name: node.module for node in block.body for alias in node.names}
    assert seen == rl_engine._EXPORTS


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"rl-engine {rl_engine.__version__}\n"


def test_metadata():
    """The license as an SPDX expression (PEP 639), the version read from rl_engine.__version__ (written once).
    The built wheel's metadata is checked in CI (.ci/run)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = "Apache-2.0"$', pyproject, re.M)
    assert re.search(r'^version = \{attr = "rl_engine.__version__"\}$', pyproject, re.M)
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "rl_engine" / "py.typed").is_file()


def test_api_page_is_up_to_date():
    """docs/api.md is generated from the public API's signatures and docstrings (python scripts/api_page.py)."""
    spec = importlib.util.spec_from_file_location("api_page", ROOT / "scripts" / "api_page.py")
    api_page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api_page)
    assert api_page.PAGE.read_text() == api_page.render(), "docs/api.md is out of date: run python scripts/api_page.py"
    planted = api_page.entry("patch", lambda model: None)  # a changed signature changes the page
    assert "(model)" in planted[3]
