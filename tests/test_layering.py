"""The layers import in one direction only (the layer table of the project's design): passes never import backends, backends never
import passes, and the core imports neither passes nor backends except where it loads plugins by name.

Checked statically on every module's import statements (top level and inside functions), so a lazy
import does not hide a wrong edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _modules(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _modules("passes"), ids=lambda p: str(p.relative_to(ROOT)))
def test_passes_do_not_import_backends(path: Path) -> None:
    bad = sorted(m for m in _imports(path) if m.startswith("mograph.backends"))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", _modules("mograph"), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_and_backends_do_not_import_passes(path: Path) -> None:
    bad = sorted(m for m in _imports(path) if m.startswith("mograph.passes"))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from mograph.passes.fusion import ops\n    import mograph.backends.ort\n")
    assert {"mograph.passes.fusion", "mograph.backends.ort"} <= _imports(probe)
