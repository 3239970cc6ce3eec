"""Sweep inputs are bounded and its outputs distinct (issue 30: R4, R7, R8).

* R4: two configurations whose names map to one file (``a/b`` and ``a_b``) were built into the same
  file, one ledger row silently getting the other's model; now the config is refused (exit 2).
* R7: a YAML alias bomb of a few hundred bytes (sweep config or precision plan) expanded into a
  megabytes-long error message; now it is refused before use and no error shows an expanded value.
* R8: a sweep killed with SIGKILL left its temporary folder; the next sweep now removes it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mograph._yaml import load_yaml_file
from mograph.cli import main
from mograph.errors import UsageError
from mograph.workflow.ledger import open_ledger
from mograph.workflow.sweep import SweepError, load_config, parse_config

sys.path.insert(0, str(Path(__file__).parent))
from test_sweep import small_model, write  # noqa: E402

#: Seven levels of nine: 9**7 = 4.8 million strings in under 400 bytes.
BOMB = """\
  a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
  b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
  c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
  d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
  e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
  f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
  g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
"""


# ------------------------------------------------------------------------------------------------- R4
@pytest.mark.parametrize("a, b", [("a/b", "a_b"), ("x y", "x_y"), ("Int8", "int8"), ("q:1", "q?1")])
def test_names_that_build_into_one_file_are_refused(a, b):
    data = {"configurations": [{"name": a, "passes": ["cleanup"]}, {"name": b, "passes": ["cse"]}]}
    with pytest.raises(SweepError, match=r"builds into the same file .* rename one"):
        parse_config(data, "s.yaml")
    parse_config({"configurations": [{"name": a, "passes": ["cleanup"]}, {"name": "other", "passes": ["cse"]}]})


def test_colliding_names_never_swap_models(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    small_model(model)
    cfg = write(tmp_path / "s.yaml", """
        eval_samples: 2
        warmup: 1
        iterations: 2
        configurations:
          - {name: a/b, passes: [cleanup]}
          - {name: a_b, passes: [prune-structured], options: {ratio: 0.5, round-to: 1}}
    """)
    (tmp_path / "kept").mkdir()
    code = main(["sweep", str(model), "--config", str(cfg), "--ledger", str(tmp_path / "l.db"), "-q",
                 "--keep-models", str(tmp_path / "kept")])
    err = capsys.readouterr().err
    assert code == 2, err  # was 4 with one a_b.onnx for both rows
    assert "builds into the same file (a_b.onnx)" in err and err.count("\n") == 1
    assert not (tmp_path / "l.db").exists() and list((tmp_path / "kept").iterdir()) == []


# ------------------------------------------------------------------------------------------------- R7
def test_sweep_config_alias_bomb_is_refused_without_expanding(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    small_model(model)
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text("version: 1\nseed:\n" + BOMB + "eval_samples: *g\nconfigurations: [{name: a, passes: [cleanup]}]\n")
    assert cfg.stat().st_size < 1024
    code = main(["sweep", str(model), "--config", str(cfg), "--ledger", str(tmp_path / "l.db")])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err) < 400 and err.count("\n") == 1, len(err)  # was 34 MB of 'lol'
    assert "aliases" in err and "lol" not in err
    assert not (tmp_path / "l.db").exists()


def test_precision_plan_alias_bomb_is_refused(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    small_model(model)
    plan = tmp_path / "plan.yaml"
    plan.write_text("pass: fp16\nx:\n" + BOMB + "nodes: [{node: *g, precision: fp16}]\n")
    code = main(["optimize", str(model), "--passes", "fp16", "--calibration-random", "2", "-o", str(tmp_path / "o.onnx"),
                 "--precision-plan", str(plan), "-q"])
    err = capsys.readouterr().err
    assert code == 2, err  # was 0, a 34 MB node name built from the plan
    assert len(err) < 400 and "aliases" in err and "lol" not in err
    assert not (tmp_path / "o.onnx").exists()


def test_yaml_bounds(tmp_path):
    ok = tmp_path / "ok.yaml"  # an anchor reused a few times is fine
    ok.write_text("base: &o {ratio: 0.5, round-to: 1}\nconfigurations:\n" +
                  "".join(f"  - {{name: c{i}, passes: [cleanup], options: *o}}\n" for i in range(20)))
    assert len(load_yaml_file(ok, "--config")["configurations"]) == 20
    cycle = tmp_path / "cycle.yaml"
    cycle.write_text("a: &a [1, *a]\n")
    with pytest.raises(UsageError, match="cycle|aliases"):
        load_yaml_file(cycle, "--config")
    big = tmp_path / "big.yaml"
    big.write_text("x: " + "y" * 2048 + "\n")
    with pytest.raises(UsageError, match="more than the 1024 a YAML file"):
        load_yaml_file(big, "--config", max_bytes=1024)
    with pytest.raises(SweepError, match="more than the"):  # a sweep config is at most 1 MiB
        big.write_text("x: " + "y" * (1 << 20) + "\n")
        load_config(big)


def test_sweep_errors_never_print_a_whole_value():
    data = {"eval_samples": ["v" * 10] * 1000, "configurations": [{"name": "a", "passes": ["cleanup"]}]}
    with pytest.raises(SweepError) as err:
        parse_config(data, "s.yaml")
    assert len(str(err.value)) < 200 and "a list of 1000 items" in str(err.value)


# ------------------------------------------------------------------------------------------------- R8
@pytest.mark.slow
def test_a_killed_sweeps_temporary_folder_is_removed_by_the_next_sweep(tmp_path, monkeypatch, capsys):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    model = tmp_path / "m.onnx"
    small_model(model, heavy=6)
    cfg = write(tmp_path / "s.yaml", """
        eval_samples: 2
        warmup: 1
        iterations: 100000
        configurations:
          - {name: a, passes: [cleanup]}
    """)
    env = {**os.environ, "TMPDIR": str(tmp), "MOGRAPH_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mograph", "sweep", str(model), "--config", str(cfg),
                             "--ledger", str(tmp_path / "l.db"), "-q"], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the built model is in the sweep's folder: it is measuring now
            left = [p for p in tmp.glob("mograph-sweep-*") if (p / "a.onnx").exists()]
            if left:
                break
            assert proc.poll() is None, "the sweep ended before it could be killed"
            time.sleep(0.2)
        else:
            pytest.fail("the sweep made no temporary folder")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert left[0].exists()  # SIGKILL runs no clean-up
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    quick = write(tmp_path / "q.yaml", """
        eval_samples: 2
        warmup: 1
        iterations: 2
        configurations:
          - {name: a, passes: [cleanup]}
    """)
    code = main(["sweep", str(model), "--config", str(quick), "--ledger", str(tmp_path / "l2.db"), "-q"])
    assert code == 0, capsys.readouterr().err
    assert not left[0].exists()  # was left forever
    assert list(tmp.glob("mograph-sweep-*")) == []
    with open_ledger(tmp_path / "l2.db", readonly=True) as ledger:
        assert [r["name"] for r in ledger.rows()] == ["baseline", "a"]
