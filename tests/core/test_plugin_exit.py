"""A plugin cannot fake success by ending the process (issue 27).

A pass that calls ``sys.exit(0)`` used to make ``mograph optimize`` exit 0 with neither the output nor
the report written, and ended a whole sweep with exit 0 and no row for any configuration.  Now
``SystemExit`` from a pass is a :class:`~mograph.errors.PluginError` naming the plugin (exit 6, nothing
written); ``KeyboardInterrupt`` keeps exit 130; in a sweep the configuration is a failed row with the
reason and the others are measured.
"""

from __future__ import annotations

import pytest

from mograph.cli import main
from mograph.workflow.ledger import open_ledger
from tests.core.test_plugins import _model_file, site, write_plugin  # noqa: F401 - site is a fixture


def _exiting_plugin(raise_what: str) -> str:
    return f'''
import sys
import mograph

class ExitPass(mograph.Pass):
    """Ends the process instead of returning a result."""

    name = "exit-pass"

    def call(self, model):
        {raise_what}

@mograph.hookimpl
def mograph_add_passes():
    return [ExitPass]
'''


@pytest.mark.parametrize("code", ["0", "None", "'done'"])
def test_pass_calling_sys_exit_is_exit_6_naming_the_plugin(site, tmp_path, capsys, code):  # noqa: F811
    write_plugin(site, "quitter", _exiting_plugin(f"sys.exit({code})"))
    model = _model_file(tmp_path)
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    rc = main(["optimize", str(model), "-o", str(out), "--passes", "cleanup,exit-pass", "--report", str(report)])
    err = capsys.readouterr().err
    assert rc == 6, err
    assert "plugin 'quitter'" in err and "exit-pass" in err and "sys.exit" in err, err
    assert [line for line in err.splitlines() if line.startswith("mograph: error")] == [err.strip().splitlines()[-1]], err
    assert not out.exists() and not report.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "site"]  # no temporary left either


def test_pass_raising_keyboard_interrupt_is_still_130(site, tmp_path, capsys):  # noqa: F811
    write_plugin(site, "ctrlc", _exiting_plugin("raise KeyboardInterrupt"))
    model = _model_file(tmp_path)
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(model), "-o", str(out), "--passes", "exit-pass"]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert not out.exists()


def test_sweep_records_the_exiting_configuration_as_failed_and_finishes_the_others(site, tmp_path, capsys):  # noqa: F811
    write_plugin(site, "quitter", _exiting_plugin("sys.exit(0)"))
    model = _model_file(tmp_path)
    cfg = tmp_path / "s.yaml"
    cfg.write_text("eval_samples: 2\nwarmup: 1\niterations: 3\nconfigurations:\n"
                   "  - {name: quits, passes: [exit-pass]}\n  - {name: clean, passes: [cleanup]}\n")
    code = main(["sweep", str(model), "--config", str(cfg), "--ledger", str(tmp_path / "l.db"), "-q"])
    assert code == 4, capsys.readouterr().err  # a sweep with a failed configuration exits 4, as before
    with open_ledger(tmp_path / "l.db", readonly=True) as ledger:
        rows = {r["name"]: r for r in ledger.rows()}
    assert set(rows) == {"baseline", "quits", "clean"}
    assert rows["quits"]["status"] == "failed" and "plugin 'quitter'" in rows["quits"]["error"], rows["quits"]
    assert "sys.exit(0)" in rows["quits"]["error"]
    assert rows["clean"]["status"] == "ok" and rows["baseline"]["status"] == "ok"


_LOADS_THEN_EXITS = '''
import sys
import mograph

class ExitPass(mograph.Pass):
    name = "exit-pass"

    def __init__(self, *args, **kwargs):
        {in_init}
        super().__init__(*args, **kwargs)

    def call(self, model):
        return mograph.PassResult(modified=False)

@mograph.hookimpl
def mograph_add_passes():
    {in_hook}
    return [ExitPass]
'''


@pytest.mark.parametrize("where", ["import", "hook", "init"])
def test_plugin_calling_sys_exit_outside_a_pass_run_is_exit_6(site, tmp_path, capsys, where):  # noqa: F811
    """sys.exit(0) when the plugin is imported, in its mograph_add_passes hook, or in the pass's constructor:
    it was exit 0 with nothing written (the process ended where the plugin said)."""
    source = _LOADS_THEN_EXITS.format(in_init="sys.exit(0)" if where == "init" else "pass",
                                      in_hook="sys.exit(0)" if where == "hook" else "pass")
    if where == "import":
        source = "import sys\nsys.exit(0)\n"
    write_plugin(site, "quitter", source)
    model = _model_file(tmp_path)
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    rc = main(["optimize", str(model), "-o", str(out), "--passes", "exit-pass" if where == "init" else "cleanup",
               "--report", str(report)])
    err = capsys.readouterr().err
    assert rc == 6, err
    assert "plugin 'quitter'" in err and "sys.exit(0)" in err, err
    assert not out.exists() and not report.exists()


def test_sweep_whose_plugin_exits_while_loading_is_exit_6(site, tmp_path, capsys):  # noqa: F811
    """A plugin whose hook calls sys.exit(0): the sweep ended with exit 0 and no ledger at all."""
    write_plugin(site, "quitter", _LOADS_THEN_EXITS.format(in_init="pass", in_hook="sys.exit(0)"))
    model = _model_file(tmp_path)
    cfg = tmp_path / "s.yaml"
    cfg.write_text("eval_samples: 2\nwarmup: 1\niterations: 3\nconfigurations:\n  - {name: clean, passes: [cleanup]}\n")
    code = main(["sweep", str(model), "--config", str(cfg), "--ledger", str(tmp_path / "l.db"), "-q"])
    err = capsys.readouterr().err
    assert code == 6, err
    assert "plugin 'quitter'" in err and "mograph_add_passes" in err, err
