"""``mograph gate``: passes a good candidate, exits 5 on accuracy or latency regressions, refuses changed inputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from mograph.cli import main
from mograph.workflow.gate import parse_percent
from mograph.workflow.ledger import open_ledger

sys.path.insert(0, str(Path(__file__).parent))
from test_sweep import small_model, write  # noqa: E402


@pytest.fixture()
def swept(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = tmp_path / "m.onnx"
    small_model(model)
    np.savez(tmp_path / "eval.npz", x=np.random.default_rng(3).standard_normal((8, 1, 8)).astype(np.float32))
    cfg = write(tmp_path / "s.yaml", """
        eval_data: eval.npz
        warmup: 3
        iterations: 30
        configurations:
          - {name: clean, passes: [cleanup]}
          - {name: pruned, passes: [prune-structured], options: {ratio: 0.5, round-to: 1}}
    """)
    (tmp_path / "kept").mkdir()
    code = main(["sweep", str(model), "--config", str(cfg), "--ledger", str(tmp_path / "l.db"), "-q",
                 "--keep-models", str(tmp_path / "kept")])
    assert code == 0
    return tmp_path


def _gate(capsys, *args) -> tuple[int, str, str]:
    code = main(["gate", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_gate_passes_and_records(swept, capsys):
    code, out, err = _gate(capsys, swept / "kept" / "clean.onnx", "--ledger", swept / "l.db",
                           "--max-latency-increase", "1000%", "--record", "clean-again")
    assert code == 0, err
    assert "gate passed: clean.onnx vs 'baseline'" in out and "measured side by side" in out
    with open_ledger(swept / "l.db", readonly=True) as ledger:
        row = ledger.get("clean-again")
    assert row["metrics"]["cosine_min"] == pytest.approx(1.0) and row["settings"]["gate"]["passed"] is True
    code, out, err = _gate(capsys, swept / "kept" / "clean.onnx", "--ledger", swept / "l.db", "--json",
                           "--baseline", "pruned", "--max-latency-increase", "1000%")
    data = json.loads(out)
    assert code == 0 and data["compared_name"] == "pruned" and data["remeasured"] is True
    assert data["accuracy_drop"] < 0  # the clean model agrees with the reference better than the pruned one


def test_gate_fails_on_accuracy(swept, capsys):
    code, out, err = _gate(capsys, swept / "kept" / "pruned.onnx", "--ledger", swept / "l.db",
                           "--max-accuracy-drop", "0.0001", "--max-latency-increase", "1000%")
    assert code == 5 and out == ""
    lines = err.strip().splitlines()  # the progress bar, then the one error line
    assert lines[0].startswith("gate: [") and sum(line.startswith("mograph:") for line in lines) == 1
    assert lines[-1].startswith("mograph: error: gate failed: accuracy: cosine_mean")
    assert "of 'baseline' (drop" in lines[-1] and "> 0.0001" in lines[-1] and "latency" not in lines[-1]


def test_gate_fails_on_latency(swept, capsys):
    slow = swept / "slow.onnx"
    small_model(slow, heavy=40)  # same outputs, 40 extra 256x256 MatMuls
    code, out, err = _gate(capsys, slow, "--ledger", swept / "l.db", "-q", "--max-latency-increase", "50%")
    assert code == 5
    assert err.startswith("mograph: error: gate failed: latency: p50") and "> 50%" in err and "accuracy" not in err
    assert len(err.strip().splitlines()) == 1


def test_gate_refuses_changed_inputs(swept, capsys):
    np.savez(swept / "eval.npz", x=np.zeros((8, 1, 8), np.float32))
    code, out, err = _gate(capsys, swept / "kept" / "clean.onnx", "--ledger", swept / "l.db")
    assert code == 2 and "evaluation set" in err and "changed" in err
    m = onnx.load(str(swept / "m.onnx"))
    m.doc_string = "retrained"
    onnx.save(m, str(swept / "m.onnx"))
    code, out, err = _gate(capsys, swept / "kept" / "clean.onnx", "--ledger", swept / "l.db")
    assert code == 2 and "baseline model" in err and "changed" in err
    code, out, err = _gate(capsys, swept / "nope.onnx", "--ledger", swept / "l.db")
    assert code == 2 and "no such file" in err
    (swept / "junk.onnx").write_bytes(b"junk")
    code, out, err = _gate(capsys, swept / "junk.onnx", "--ledger", swept / "l.db")
    assert code == 3, err
    code, out, err = _gate(capsys, swept / "kept" / "clean.onnx", "--ledger", swept / "none.db")
    assert code == 2 and "does not exist" in err
    code, out, err = _gate(capsys, swept / "kept" / "clean.onnx", "--ledger", swept / "l.db", "--baseline", "zzz")
    assert code == 2 and "no row 'zzz'" in err


def test_parse_percent():
    assert parse_percent("10%") == pytest.approx(0.10) and parse_percent("2.5") == pytest.approx(0.025)
    with pytest.raises(Exception, match="percentage"):
        parse_percent("ten")


@pytest.mark.parametrize("record", [False, True])
def test_gate_never_creates_a_missing_ledger(tmp_path, capsys, record):
    missing = tmp_path / "none.db"
    code = main(["gate", str(tmp_path / "c.onnx"), "--ledger", str(missing), *(["--record", "x"] if record else [])])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert not missing.exists()


def test_gate_never_fails_an_unchanged_model_in_20_runs(swept, capsys):
    """The baseline model gated against itself, 20 times in a row on a busy machine: never a latency failure
    (the noise-aware rule: lower end of the ratio's interval over interleaved series, not one p50 ratio)."""
    ratios = []
    for _ in range(20):
        code, out, err = _gate(capsys, swept / "m.onnx", "--ledger", swept / "l.db", "--json", "-q",
                               "--runs", "5", "--repeats", "3")
        assert code == 0, err
        data = json.loads(out)
        low, high = data["latency_interval"]
        assert low <= data["latency_ratio"] <= high
        assert data["latency_runs"]["runs"] == 5 and data["latency_runs"]["repeats"] == 3
        assert [len(s) for s in data["latency_runs"]["candidate_ms"]] == [5, 5, 5]
        ratios.append(data["latency_ratio"])
    assert len(ratios) == 20


def test_gate_json_carries_the_measurements_on_failure(swept, capsys):
    slow = swept / "slow.onnx"
    small_model(slow, heavy=40)
    code, out, err = _gate(capsys, slow, "--ledger", swept / "l.db", "--json", "--max-latency-increase", "50%",
                           "--runs", "6", "--repeats", "2")
    assert code == 5
    data = json.loads(out)
    assert data["exit_code"] == 5 and data["error"].startswith("gate failed: latency: p50")
    assert data["passed"] is False and data["reasons"] and data["latency_interval"][0] > 1.5
    assert data["candidate"]["latency_p50_ms"] > data["compared"]["latency_p50_ms"]
    assert [len(s) for s in data["latency_runs"]["compared_ms"]] == [6, 6]
    assert "interval" in err and "2x6 interleaved runs" in err


def test_gate_rejects_bad_runs_and_repeats(swept, capsys):
    for flag in ("--runs", "--repeats"):
        code, out, err = _gate(capsys, swept / "m.onnx", "--ledger", swept / "l.db", flag, "0")
        assert code == 2 and f"{flag} 0: must be at least 1" in err


def test_latency_interval_is_noise_aware():
    from mograph.workflow.gate import latency_interval

    rng = np.random.default_rng(0)
    same = [list(1.0 + rng.exponential(0.2, 10)) for _ in range(4)]
    other = [list(1.0 + rng.exponential(0.2, 10)) for _ in range(4)]
    other[1] = [x * 5 for x in other[1]]  # one series disturbed (the machine was busy): the median ignores it
    ratio, low, high, per = latency_interval(other, same)
    assert low <= ratio <= high and len(per) == 4 and per[1] > 3
    assert low < 1.1 and 0.7 < ratio < 1.3
    slow = [[x * 2 for x in s] for s in same]
    ratio, low, high, _ = latency_interval(slow, same)
    assert ratio == pytest.approx(2.0) and low > 1.5
    assert latency_interval(slow, same) == latency_interval(slow, same)  # seeded: reproducible
