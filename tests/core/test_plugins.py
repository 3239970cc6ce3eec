"""The plugin system: hookspecs as the author's manual, built-ins through the same door, blocking,
autoload switch, and broken plugins reported by name (exit code 6 from the CLI).

Third-party plugins are simulated without pip: a package and a ``*.dist-info`` folder holding
``entry_points.txt`` are written into a temporary folder put on ``sys.path`` (in-process) or on
``PYTHONPATH`` (for the console script in a subprocess) — that is all ``importlib.metadata`` needs.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import mograph
from models.builders import make_model
from mograph import hookspecs, plugins
from mograph.cli import main
from mograph.errors import PluginError


def _pass_plugin(cls: str, name: str, doc: str) -> str:
    """Source of a plugin module whose one pass, ``cls`` called ``name``, changes nothing."""
    return f'''
import mograph

class {cls}(mograph.Pass):
    """{doc}"""

    name = "{name}"

    def call(self, model):
        return mograph.PassResult(modified=False)

@mograph.hookimpl
def mograph_add_passes():
    return [{cls}]
'''


GOOD = _pass_plugin("FakePass", "fake-pass", "Do nothing, from a third-party plugin.") + '''
@mograph.hookimpl
def mograph_add_presets():
    return {"fake-preset": ["cleanup", "fake-pass"]}

def add_passes():  # not prefixed: not a hook, never called
    raise AssertionError("unprefixed functions are not hooks")
'''

IMPORT_ERROR = "import mograph\nimport a_module_that_does_not_exist\n"

HOOK_RAISES = '''
import mograph

@mograph.hookimpl
def mograph_add_passes():
    raise RuntimeError("registry exploded")
'''

DUPLICATE = _pass_plugin("MyCse", "cse", "Another pass called cse.")


def write_plugin(site: Path, plugin: str, source: str | None, *, target: str | None = None) -> str:
    """Write module + dist-info declaring entry point ``plugin`` in group ``mograph``; return the module name."""
    module = f"mograph_fake_{plugin.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
    if source is not None:
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    dist = site / f"{module}-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[mograph]\n{plugin} = {target or module}\n")
    return module


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for fake distributions; registries rebuilt before and after."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delenv(plugins.AUTOLOAD_ENV, raising=False)
    monkeypatch.delenv(plugins.BLOCK_ENV, raising=False)
    importlib.invalidate_caches()
    plugins.reset()
    before = set(sys.modules)
    yield folder
    for name in set(sys.modules) - before:
        if name.startswith("mograph_fake_"):
            del sys.modules[name]
    plugins.reset()


def _model_file(folder: Path) -> Path:
    path = folder / "m.onnx"
    nodes = [helper.make_node("Identity", ["x"], ["t"]), helper.make_node("Relu", ["t"], ["y"])]
    onnx.save(make_model(nodes, [("x", np.float32, [2])], [("y", np.float32, [2])]), path)
    return path


def _cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# --- hookspecs are the manual ----------------------------------------------------------------------


def test_every_hookspec_is_documented():
    specs = [name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("mograph_")]
    assert sorted(specs) == [
        "mograph_add_backends", "mograph_add_custom_ops", "mograph_add_foreign_ops", "mograph_add_passes", "mograph_add_presets",
        "mograph_add_targets",
        "mograph_precision_recipe", "mograph_run_pass",
    ]
    for name in specs:
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert len(doc.splitlines()) >= 5, f"{name} needs a real docstring"
        assert "Returns:" in doc, f"{name}: say what a return value means"
        assert "Called" in doc, f"{name}: say when it is called"
    manual = hookspecs.__doc__ or ""
    for needle in ("[project.entry-points.mograph]", "MOGRAPH_DISABLE_PLUGIN_AUTOLOAD", "MOGRAPH_BLOCK_PLUGINS",
                   "--block-plugin", "mograph_"):
        assert needle in manual


def test_builtins_register_through_the_same_hooks():
    reg = plugins.get_registry()
    cleanup = importlib.import_module("mograph.passes.cleanup")
    assert reg.pm.get_plugin("mograph.passes.cleanup") is cleanup
    impls = {reg.pm.get_name(i.plugin) for i in reg.pm.hook.mograph_add_passes.get_hookimpls()}
    assert "mograph.passes.cleanup" in impls
    for name in ("infer-shapes", "fold-constants", "simplify-shapes", "eliminate-identity", "cse", "eliminate-dead",
                 "topo-sort"):
        assert reg.pass_source[name] == "mograph.passes.cleanup"
    assert reg.preset_source["cleanup"] == "mograph.passes.cleanup"
    listed = {p["name"]: p["plugin"] for p in mograph.list_passes()}
    assert listed["cse"] == "mograph.passes.cleanup"


def test_a_builtin_can_be_blocked_by_name():
    pm = plugins.get_plugin_manager(blocked=["mograph.passes.cleanup"], autoload=False)
    reg = plugins.Registry.build(pm)
    assert "cse" not in reg.passes and "cleanup" not in reg.presets


# --- third-party plugins ---------------------------------------------------------------------------


def test_entry_point_plugin_is_loaded_under_its_name(site, capsys):
    module = write_plugin(site, "fake", GOOD)
    reg = plugins.get_registry()
    assert reg.pass_source["fake-pass"] == "fake"
    assert reg.expand("fake-preset")[-1] == "fake-pass"
    code, out, _ = _cli(capsys, "passes", "--json")
    assert code == 0
    listed = {p["name"]: p["plugin"] for p in json.loads(out)["passes"]}
    assert listed["fake-pass"] == "fake"
    assert module in sys.modules


@pytest.mark.parametrize("how", ["env", "argument", "cli-flag", "cli-flag-before-command"])
def test_blocked_plugin_is_not_loaded(site, monkeypatch, capsys, how):
    module = write_plugin(site, "fake", GOOD)
    if how == "env":
        monkeypatch.setenv(plugins.BLOCK_ENV, "other, fake")
        reg = plugins.get_registry()
    elif how == "argument":
        reg = plugins.get_registry(blocked=["fake"])
    else:
        argv = ["passes", "--json", "--block-plugin", "fake"]
        if how == "cli-flag-before-command":
            argv = ["--block-plugin", "fake", "passes", "--json"]
        code, out, _ = _cli(capsys, *argv)
        assert code == 0
        assert "fake-pass" not in {p["name"] for p in json.loads(out)["passes"]}
        reg = plugins.get_registry(blocked=["fake"])
    assert "fake-pass" not in reg.passes
    assert "cse" in reg.passes
    assert module not in sys.modules  # never even imported


def test_autoload_can_be_disabled(site, monkeypatch):
    module = write_plugin(site, "fake", GOOD)
    monkeypatch.setenv(plugins.AUTOLOAD_ENV, "1")
    reg = plugins.get_registry()
    assert "fake-pass" not in reg.passes
    assert reg.pass_source["cse"] == "mograph.passes.cleanup"  # built-ins are not entry points
    assert module not in sys.modules
    monkeypatch.setenv(plugins.AUTOLOAD_ENV, "0")
    assert "fake-pass" in plugins.get_registry().passes


BROKEN = {
    "import-error": (IMPORT_ERROR, None, "plugin 'broken' (", "failed to load: ModuleNotFoundError"),
    "missing-module": (None, "mograph_fake_not_there", "plugin 'broken' (mograph_fake_not_there) failed to load", ""),
    "hook-raises": (HOOK_RAISES, None, "plugin 'broken' failed in mograph_add_passes: RuntimeError: registry exploded", ""),
    "duplicate-pass": (DUPLICATE, None, "pass name 'cse' is provided by both 'mograph.passes.cleanup' and 'broken'", ""),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_plugin_is_a_plugin_error_naming_it(site, capsys, case):
    source, target, fragment, more = BROKEN[case]
    write_plugin(site, "broken", source, target=target)
    with pytest.raises(PluginError) as info:
        plugins.get_registry()
    assert fragment in str(info.value) and more in str(info.value)
    code, out, err = _cli(capsys, "passes")
    assert code == PluginError.exit_code == 6
    assert err.splitlines() == [f"mograph: error: {info.value}"]
    # Blocking the broken plugin by name gets the user going again.
    code, _, _ = _cli(capsys, "passes", "--block-plugin", "broken")
    assert code == 0


def test_broken_plugin_through_the_console_script(site, tmp_path):
    """The real ``mograph`` process: exit 6 and one line; ``--help`` and a blocked run still work."""
    write_plugin(site, "broken", HOOK_RAISES)
    model = _model_file(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    env.pop(plugins.BLOCK_ENV, None)
    env.pop(plugins.AUTOLOAD_ENV, None)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "mograph", *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)

    failed = run("optimize", str(model), "-q")
    assert failed.returncode == 6
    assert failed.stderr.splitlines() == [
        "mograph: error: plugin 'broken' failed in mograph_add_passes: RuntimeError: registry exploded"
    ]
    assert not (tmp_path / "m.opt.onnx").exists()
    assert run("--help").returncode == 0
    blocked = run("optimize", str(model), "-q", "--block-plugin", "broken", "--fold-limit", "8")
    assert blocked.returncode == 0, blocked.stderr
    assert (tmp_path / "m.opt.onnx").exists()


# --- hooks that match nothing, options that mean two things ---------------------------------------

MISSPELLED = '''
import mograph

@mograph.hookimpl
def mograph_add_pass():
    return []
'''

RATIO_A = '''
import mograph

class A(mograph.Pass):
    """Pass a."""

    name = "ratio-a"
    options = (mograph.Option("fake-ratio", float, 0.5, "a fraction"),)

    def call(self, model):
        return mograph.PassResult(modified=False)

@mograph.hookimpl
def mograph_add_passes():
    return [A]
'''

RATIO_B_SAME = RATIO_A.replace('"ratio-a"', '"ratio-b"').replace('"""Pass a."""', '"""Pass b."""').replace(
    '"a fraction"', '"another help text is fine"'
)
RATIO_B_INT = RATIO_B_SAME.replace("float, 0.5", "int, 3")


def test_misspelled_hook_is_a_plugin_error_naming_the_plugin(site, capsys):
    write_plugin(site, "typo", MISSPELLED)
    with pytest.raises(PluginError) as info:
        plugins.get_registry()
    assert str(info.value) == (
        "plugin 'typo' implements mograph_add_pass, which is not a mograph hook (did you mean mograph_add_passes?); "
        "the hooks are documented in mograph.hookspecs"
    )
    code, _, err = _cli(capsys, "passes")
    assert code == 6 and err.splitlines() == [f"mograph: error: {info.value}"]


def test_options_declared_alike_by_two_plugins_are_shared(site):
    write_plugin(site, "one", RATIO_A)
    write_plugin(site, "two", RATIO_B_SAME)
    opt, owners = plugins.get_registry().all_options()["fake_ratio"]
    assert owners == ["ratio-a", "ratio-b"] and opt.type is float


def test_option_with_two_meanings_is_a_plugin_error_naming_both(site):
    write_plugin(site, "one", RATIO_A)
    write_plugin(site, "two", RATIO_B_INT)
    with pytest.raises(PluginError) as info:
        plugins.get_registry()
    assert str(info.value) == (
        "option '--fake-ratio' means two things: pass 'ratio-a' of plugin 'one' and pass 'ratio-b' of plugin 'two' "
        "declare it with different types (float and int), defaults (0.5 and 3); one of them must rename it"
    )


def test_a_plugin_option_clashing_with_a_builtin_one_names_both(site):
    write_plugin(site, "one", RATIO_A.replace('"fake-ratio"', '"ratio"'))
    with pytest.raises(PluginError, match=r"option '--ratio' means two things: pass 'prune-structured' of plugin "
                                          r"'mograph.passes.prune' and pass 'ratio-a' of plugin 'one'"):
        plugins.get_registry()


def test_builtin_option_declarations_agree():
    # Every option name shared by built-in passes (--shape, --target, --exclude ...) means one thing.
    reg = plugins.Registry.build(plugins.get_plugin_manager(autoload=False))
    assert sum(len(owners) > 1 for _opt, owners in reg.all_options().values()) >= 5


# --- a plugin backend gets the same doors -----------------------------------------------------------

#: The smallest backend the hookspec allows: a name and make_runner, nothing optional.
MINIMAL_BACKEND = '''
import mograph
import numpy as np

class Mini:
    name = "mini"

    def __init__(self):
        self.calls = []

    def make_runner(self, model, *, optimizations=True, threads=None, providers=None):
        from mograph.backends import ort
        self.calls.append(optimizations)
        session = ort.make_session(model, optimizations=False)

        def run(feeds):
            return ort.run(session, feeds)

        return run

BACKEND = Mini()

@mograph.hookimpl
def mograph_add_backends():
    return [BACKEND]
'''

MISSING_RUNTIME = '''
import mograph

class Missing:
    name = "missing"
    extra = "missing"

    def available(self):
        return False

    def why_unavailable(self):
        return "the missing runtime is not installed: pip install missing-runtime"

    def make_runner(self, model, **kwargs):
        raise AssertionError("never called when unavailable")

@mograph.hookimpl
def mograph_add_backends():
    return [Missing()]
'''

NOT_A_BACKEND = '''
import mograph

class NoRunner:
    name = "norunner"

@mograph.hookimpl
def mograph_add_backends():
    return [NoRunner()]
'''


def _matmul_file(folder: Path, seed: int = 0) -> Path:
    path = folder / f"mm{seed}.onnx"
    w = np.random.default_rng(seed).standard_normal((8, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 4])],
        [onnx.numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_minimal_plugin_backend_works_in_bench_validate_and_diff(site, capsys, tmp_path):
    module = write_plugin(site, "mini", MINIMAL_BACKEND)
    model = _matmul_file(tmp_path)
    code, out, err = _cli(capsys, "bench", str(model), "--backend", "mini", "--json", "--warmup", "0", "--iterations", "2")
    assert code == 0, err  # no AttributeError for the optional members it lacks
    assert json.loads(out)["backend"] == "mini"
    code, out, err = _cli(capsys, "validate", str(model), "--backend", "mini", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["passed"] is True and data["backend"] == "mini" and data["target"] == "mini"
    assert data["candidate"] == f"backend 'mini' on {model}"
    code, out, err = _cli(capsys, "diff", str(model), str(_matmul_file(tmp_path, seed=1)), "--backend", "mini")
    assert code == 5 and "run on: backend 'mini'" in out
    calls = sys.modules[module].BACKEND.calls
    assert calls == [True, True, False, False]  # bench and validate: optimizations on; diff: off on both sides
    code, _, err = _cli(capsys, "build", str(model), "--backend", "mini")
    assert code == 2 and "unknown --backend 'mini' for build: it builds no artifact" in err


def test_unavailable_plugin_backend_says_why_with_exit_7(site, capsys, tmp_path):
    write_plugin(site, "missing", MISSING_RUNTIME)
    model = _matmul_file(tmp_path)
    for command in ("bench", "validate"):
        code, _, err = _cli(capsys, command, str(model), "--backend", "missing")
        assert code == 7
        assert err.splitlines() == ["mograph: error: the missing runtime is not installed: pip install missing-runtime"]


def test_object_without_make_runner_is_a_plugin_error(site):
    write_plugin(site, "bad-backend", NOT_A_BACKEND)
    with pytest.raises(PluginError, match=r"plugin 'bad-backend' returned .* which is not a backend: it has no "
                                          r"make_runner\(model, \.\.\.\) method"):
        plugins.get_registry()


def test_backend_name_clash_names_both_plugins(site):
    write_plugin(site, "other-ort", MINIMAL_BACKEND.replace('name = "mini"', 'name = "ort"'))
    with pytest.raises(PluginError, match="backend 'ort' is provided by both 'mograph.backends' and 'other-ort'"):
        plugins.get_registry()


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("fuse-layrnorm", "fuse-layernorm"), ("eliminate-ded", "eliminate-dead"), ("cleanpu", "cleanup")],
)
def test_a_mistyped_pass_name_suggests_the_close_ones(typo, meant):
    from mograph.errors import UnknownPassError

    with pytest.raises(UnknownPassError) as info:
        plugins.get_registry().expand(["cleanup", typo])
    message = str(info.value)
    assert f"unknown pass or preset '{typo}'" in message
    assert "did you mean" in message and meant in message.split("did you mean", 1)[1]


def test_a_name_like_no_pass_gets_no_suggestion():
    from mograph.errors import UnknownPassError

    with pytest.raises(UnknownPassError) as info:
        plugins.get_registry().expand("zzzzqqq")
    assert "did you mean" not in str(info.value)
