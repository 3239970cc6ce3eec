"""The layers import in one direction only: the core is a stack, and the built-in plugins sit on it.

Bottom to top (:data:`LAYERS`): declarations (errors, metadata, specs, custom-op, target and TensorRT
plugin records, the backend protocol, and leaf utilities), the IR toolbox, the pass infrastructure and
patterns, the registry (plugin manager and hook specs), the lowering, then the plugins that implement
passes (``passes/``, importable as ``mograph.passes``) and backends (``mograph/backends/``), which never
import each other, and at the top the composition roots (api, cli, profile, validate, workflow, the
testing helpers), which alone look up the registry (``get_registry()``) and hand it down.

A module may import its own layer and the layers below it, never one above.  Checked statically on
every import statement of every module, at the top level, inside functions and under
``TYPE_CHECKING`` alike, so a deferred import does not hide a wrong edge.  Built-in plugins are loaded by
*name* (:data:`mograph.plugins.BUILTIN_PLUGINS`), as entry points are: a string, not an import.

Exceptions: none.  An exception would be an entry of :data:`EXCEPTIONS` (importer, imported) with the
reason it is there.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Bottom to top: (layer, module names or package prefixes).  Every module of ``mograph/`` and
#: ``passes/`` must be listed (a new module is a decision about its layer).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("declarations", (
        "mograph.errors", "mograph.metadata", "mograph.specs", "mograph.custom_ops", "mograph.targets", "mograph.foreign_ops",
        "mograph.kernel_plugins", "mograph.backend_protocol",
        # leaf utilities that know nothing of models or plugins
        "mograph._signals", "mograph._tempfiles", "mograph._yaml", "mograph._paths", "mograph.progress",
        "mograph.cuda_graph", "mograph._kernels", "mograph.examples", "mograph._user_code",
        # the .onnx file's wire format, read without copying weights (imports no mograph module; _paths uses it)
        "mograph._stream_load",
        # where work runs (in process or on Ray): the quant passes fan out through it as the workflow does
        "mograph.workflow.executors",
    )),
    ("ir", (
        "mograph.ir_version", "mograph._traverse", "mograph._model_checks", "mograph._spill", "mograph.ir_io",
        "mograph.irutil", "mograph.opset", "mograph.inspect", "mograph.output_check", "mograph._ort_parts",
        "mograph.shapes",  # the shape facility: dim algebra, per-op rules, the query passes ask
    )),
    ("pass-infra", ("mograph.pass_infra", "mograph.patterns", "mograph.pattern_explain")),
    ("registry", ("mograph.hookspecs", "mograph.plugins")),
    ("lowering", ("mograph.lowering",)),
    ("plugins", ("mograph.passes", "mograph.backends")),
    ("roots", (
        "mograph", "mograph.__main__", "mograph.api", "mograph.cli", "mograph.profile", "mograph.validate",
        "mograph.workflow", "mograph.testing",
    )),
)

#: Plugin packages on one layer that must not import each other: passes never import backends, backends
#: never import passes (what both need lives below them, in the core).
SIBLINGS = (("mograph.passes", "mograph.backends"), ("mograph.backends", "mograph.passes"))

#: Modules that may call ``get_registry()``: the composition roots, and the registry that defines it.
REGISTRY_LOOKUP = ("roots",)

#: (importer, imported) -> why the upward edge is allowed.  Empty: the stack has no exception.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "passes":
        parts = ["mograph", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


ALL = {_module_name(p): p for folder in ("mograph", "passes") for p in _modules(folder)}


def _imports(path: Path, name: str | None = None) -> set[str]:
    """Every module ``path`` imports (``from a import b``: ``a.b`` where that is a module, else ``a``), relative
    ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = name or path.stem
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            for alias in node.names:  # ``from pkg import sub`` imports ``pkg.sub`` (``pkg`` itself is the parent
                full = f"{module}.{alias.name}"  # every submodule import initializes anyway)
                out.add(full if full in ALL else module)
    return out


def _target(imported: str) -> str | None:
    """The mograph module an imported name refers to (``mograph.x.y`` -> the longest known prefix)."""
    if imported != "mograph" and not imported.startswith("mograph."):
        return None
    parts = imported.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in ALL:
            return candidate
        parts.pop()
    return None


def _layer(module: str) -> int:
    best, found = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            covers = module == prefix or (prefix != "mograph" and module.startswith(prefix + "."))  # the package
            if covers and len(prefix) > best:  # ``mograph`` itself is its __init__ only, not every module
                best, found = len(prefix), i
    return found


def _edges(module: str) -> set[str]:
    return {t for m in _imports(ALL[module], module) if (t := _target(m)) is not None and t != module}


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in ALL if _layer(m) < 0)
    assert not missing, f"modules without a layer in LAYERS: {missing}"


@pytest.mark.parametrize("module", sorted(ALL), ids=str)
def test_no_upward_import(module: str) -> None:
    mine = _layer(module)
    bad = []
    for imported in sorted(_edges(module)):
        theirs = _layer(imported)
        if theirs > mine and (module, imported) not in EXCEPTIONS:
            bad.append(f"{imported} ({LAYERS[theirs][0]})")
    assert not bad, f"{module} ({LAYERS[mine][0]}) imports upward: {bad}"


@pytest.mark.parametrize("module", sorted(ALL), ids=str)
def test_sibling_plugins_do_not_import_each_other(module: str) -> None:
    for importer, forbidden in SIBLINGS:
        if module == importer or module.startswith(importer + "."):
            bad = sorted(m for m in _edges(module) if m == forbidden or m.startswith(forbidden + "."))
            assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module", sorted(ALL), ids=str)
def test_only_composition_roots_look_up_the_registry(module: str) -> None:
    if LAYERS[_layer(module)][0] in REGISTRY_LOOKUP or module == "mograph.plugins":
        return
    tree = ast.parse(ALL[module].read_text())
    uses = sorted({n.lineno for n in ast.walk(tree)
                   if (isinstance(n, ast.Name) and n.id == "get_registry")
                   or (isinstance(n, ast.Attribute) and n.attr == "get_registry")
                   or (isinstance(n, ast.alias) and n.name == "get_registry")})
    assert not uses, f"{module} looks up the registry itself (lines {uses}): take it as a parameter"


def test_the_exceptions_are_justified() -> None:
    for (importer, imported), why in EXCEPTIONS.items():
        assert importer in ALL and imported in ALL and len(why) > 20, (importer, imported)


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from mograph.passes.fusion import ops\n    import mograph.backends.ort\n"
                     "if TYPE_CHECKING:\n    from mograph.plugins import Registry\n")
    assert {"mograph.passes.fusion.ops", "mograph.backends.ort", "mograph.plugins"} <= _imports(probe)
    assert _target("mograph.plugins.Registry") == "mograph.plugins"
    assert _layer("mograph.plugins") > _layer("mograph.irutil")
    assert _layer("mograph.not_listed") == -1  # a new module must be given a layer (the package is not a catch-all)


def test_the_check_resolves_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "mod.py"
    pkg.write_text("from . import _feeds\nfrom ..backends import ort\n")
    assert {"mograph.validate._feeds", "mograph.backends.ort"} <= _imports(pkg, "mograph.validate.mod")


def _reach(module: str) -> set[str]:
    """Every module ``module`` imports, directly or through others (static edges, deferred imports included)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for m in _edges(todo.pop()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_the_attention_proofs_do_not_import_the_fusion() -> None:
    """The fusion reads the lowering's proofs (``is_zero_bias``); the proofs read only leaf modules of the fusion
    (``_attention_rotary``), never the fusion itself: no import cycle between them."""
    fusion, proofs = "mograph.passes.fusion.attention", "mograph.passes.fusion.lowerings.attention_proofs"
    assert proofs in _reach(fusion)
    assert fusion not in _reach(proofs)
