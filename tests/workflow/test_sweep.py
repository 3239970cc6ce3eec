"""``mograph sweep``: the config schema and its errors, the shipped example, failed configurations, task metrics."""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph.cli import main
from mograph.workflow.ledger import open_ledger
from mograph.workflow.sweep import SweepError, check_against_registry, load_config, parse_config


def small_model(path, heavy: int = 0) -> None:
    """x[batch,8] -> Relu(x @ w1 + b1) @ w2 (a small FFN); ``heavy`` adds that many 256x256 MatMuls whose
    result is multiplied by zero (same outputs, much slower)."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["y"]),
        helper.make_node("Add", ["y", "b1"], ["yb"]),
        helper.make_node("Relu", ["yb"], ["h"]),
        helper.make_node("MatMul", ["h", "w2"], ["r"]),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal(16).astype(np.float32) * 0.1, "b1"),
        numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "w2"),
    ]
    if heavy:
        inits.append(numpy_helper.from_array(rng.standard_normal((8, 256)).astype(np.float32) * 0.01, "up"))
        inits.append(numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32) * 0.01, "sq"))
        inits.append(numpy_helper.from_array(rng.standard_normal((256, 4)).astype(np.float32) * 0.01, "down"))
        inits.append(numpy_helper.from_array(np.zeros((1,), np.float32), "zero"))
        nodes.append(helper.make_node("MatMul", ["x", "up"], ["h0"]))
        for i in range(heavy):
            nodes.append(helper.make_node("MatMul", [f"h{i}", "sq"], [f"h{i + 1}"]))
        nodes += [
            helper.make_node("MatMul", [f"h{heavy}", "down"], ["hd"]),
            helper.make_node("Mul", ["hd", "zero"], ["hz"]),
            helper.make_node("Add", ["r", "hz"], ["z"]),
        ]
    else:
        nodes.append(helper.make_node("Identity", ["r"], ["z"]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 4])], inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


# ------------------------------------------------------------------------------------------ the schema
@pytest.mark.parametrize(
    "data, message",
    [
        ([1, 2], "expected a mapping"),
        ({}, "no 'configurations' list"),
        ({"configurations": []}, "non-empty list"),
        ({"configuratons": [{"name": "a", "passes": ["cse"]}]}, "unknown key 'configuratons' .did you mean configurations"),
        ({"version": 2, "configurations": [{"name": "a", "passes": ["cse"]}]}, "version 2 is not supported"),
        ({"configurations": [{"name": "a", "pases": ["cse"]}]}, r"configurations\[0\]: unknown key 'pases' .did you mean passes"),
        ({"configurations": [{"passes": ["cse"]}]}, "name: expected a non-empty string"),
        ({"configurations": [{"name": "baseline", "passes": ["cse"]}]}, "'baseline' is the unoptimized model"),
        ({"configurations": [{"name": "a", "passes": ["cse"]}, {"name": "a", "passes": ["cse"]}]}, "used twice"),
        ({"configurations": [{"name": "a", "passes": []}]}, "passes must be a non-empty list"),
        ({"configurations": [{"name": "a", "passes": ["cse"], "options": [1]}]}, "options must be a mapping"),
        ({"iterations": 0, "configurations": [{"name": "a", "passes": ["cse"]}]}, "iterations: expected an integer >= 1"),
        ({"warmup": "3", "configurations": [{"name": "a", "passes": ["cse"]}]}, "warmup: expected an integer"),
        ({"shapes": {"x": [1, "b"]}, "configurations": [{"name": "a", "passes": ["cse"]}]}, r"shapes.x: expected a list of sizes"),
        ({"shapes": {"x": "1xq"}, "configurations": [{"name": "a", "passes": ["cse"]}]}, "not an integer"),
        ({"ort_optimizations": "yes", "configurations": [{"name": "a", "passes": ["cse"]}]}, "expected true or false"),
        ({"provider": 3, "configurations": [{"name": "a", "passes": ["cse"]}]}, "provider: expected a provider name"),
        ({"session_config": ["a=1"], "configurations": [{"name": "a", "passes": ["cse"]}]},
         "session_config: expected a mapping"),
        ({"configurations": [{"name": "a", "passes": ["cse"], "session_config": {"k": [1]}}]}, "expected KEY: VALUE"),
        ({"backend": "tensorrt", "session_config": {"k": 1}, "configurations": [{"name": "a", "passes": ["cse"]}]},
         "session_config sets ONNX Runtime sessions"),
    ],
)
def test_schema_errors(data, message):
    with pytest.raises(SweepError, match=message):
        parse_config(data, "s.yaml")


def test_registry_errors():
    sweep = parse_config({"configurations": [{"name": "a", "passes": ["cleanup", "fuse-layernrom"]}]}, "s.yaml")
    with pytest.raises(SweepError, match="configuration 'a': unknown pass or preset 'fuse-layernrom' .did you mean fuse-layernorm"):
        check_against_registry(sweep)
    sweep = parse_config({"configurations": [{"name": "a", "passes": "cleanup", "options": {"fold-limt": 3}}]}, "s.yaml")
    with pytest.raises(SweepError, match="unknown pass option 'fold-limt' .did you mean fold-limit"):
        check_against_registry(sweep)
    sweep = parse_config({"configurations": [{"name": "a", "passes": "cleanup", "options": {"ratio": 0.5}}]}, "s.yaml")
    with pytest.raises(SweepError, match="option 'ratio' is taken by prune-structured, none of which is in its pipeline"):
        check_against_registry(sweep)
    sweep = parse_config({"configurations": [{"name": "a", "passes": "cleanup,fuse", "options": {"target": "ort"}}]}, "s")
    assert check_against_registry(sweep)["a"][-4] == "lower"  # then the after-lower preset


def test_config_file_errors_and_relative_paths(tmp_path, capsys):
    bad = write(tmp_path / "bad.yaml", "configurations: [name: a\n")
    with pytest.raises(SweepError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(SweepError, match="no such file"):
        load_config(tmp_path / "none.yaml")
    (tmp_path / "data").mkdir()
    np.savez(tmp_path / "data" / "e.npz", x=np.ones((3, 1, 8), np.float32))
    good = write(tmp_path / "data" / "s.yaml", """
        eval_data: e.npz
        task_metric: m.py:score
        configurations: [{name: a, passes: [cse], shapes: ["x:2x8"]}]
    """)
    (tmp_path / "data" / "m.py").write_text("def score(outputs, samples):\n    return 1.0\n")
    sweep = load_config(good)
    assert sweep.eval_data == str((tmp_path / "data" / "e.npz").resolve())
    assert sweep.task_metric == f"{(tmp_path / 'data' / 'm.py').resolve()}:score"
    assert sweep.configurations[0].shapes == {"x": (2, 8)}
    # The CLI refuses a bad config before touching the model or the ledger.
    model = tmp_path / "m.onnx"
    small_model(model)
    typo = write(tmp_path / "t.yaml", "configurations: [{name: a, passes: [cse, fold-constant]}]\n")
    code = main(["sweep", str(model), "--config", str(typo), "--ledger", str(tmp_path / "l.db")])
    err = capsys.readouterr().err
    assert code == 2 and "unknown pass or preset 'fold-constant'" in err and "did you mean fold-constants" in err
    assert not (tmp_path / "l.db").exists()


# ------------------------------------------------------------------------------------------ running
def test_shipped_example_sweep(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    code = main(["sweep", "--example", "bert-tiny", "--ledger", "l.db", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0, data
    with open_ledger(tmp_path / "l.db", readonly=True) as ledger:
        rows = {r["name"]: r for r in ledger.rows()}
    assert list(rows) == ["baseline", "fused", "fp16", "int8", "int8-budget", "pruned"]
    assert all(r["status"] == "ok" for r in rows.values())
    base = rows["baseline"]
    assert base["baseline"] is True and base["pipeline"] == []
    m0 = base["metrics"]
    assert m0["cosine_min"] == pytest.approx(1.0) and m0["max_abs"] == 0.0 and m0["top1_agreement"] == 1.0
    for r in rows.values():
        m = r["metrics"]
        assert 0 < m["latency_p50_ms"] <= m["latency_p90_ms"] <= m["latency_p99_ms"] and m["throughput"] > 0
        assert m["size_bytes"] > 0 and m["peak_mem_mb"] is not None
        assert r["eval_hash"] == base["eval_hash"] and r["model_hash"] == base["model_hash"]
        assert r["versions"]["onnx"] == onnx.__version__ and r["provider"] == "CPUExecutionProvider"
        assert r["settings"]["eval_samples"] == 2 and r["settings"]["iterations"] == 20
    fused = rows["fused"]
    assert fused["pipeline"][-4] == "lower" and "fuse-layernorm" in fused["pipeline"]
    assert fused["metrics"]["max_abs"] < 1e-4 and fused["calib_hash"] is None
    assert any(p["name"] == "fuse-attention" for p in fused["report"])
    assert rows["fp16"]["metrics"]["size_bytes"] < 0.7 * m0["size_bytes"]
    assert rows["int8"]["metrics"]["size_bytes"] < 0.7 * m0["size_bytes"]
    assert rows["int8"]["calib_hash"] and rows["int8"]["calib_hash"] == rows["int8-budget"]["calib_hash"]
    assert rows["int8"]["plan"] and rows["fp16"]["plan"]
    assert rows["int8-budget"]["options"]["accuracy_budget"] == "cosine>=0.999"
    assert rows["int8-budget"]["metrics"]["cosine_min"] >= 0.999  # the budget held on these samples
    assert rows["pruned"]["metrics"]["size_bytes"] < m0["size_bytes"]
    assert rows["pruned"]["metrics"]["cosine_min"] < 1.0
    assert [r["name"] for r in data["rows"]] == list(rows)


def test_failed_configuration_is_a_row(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    small_model(model)
    cfg = write(tmp_path / "s.yaml", """
        eval_samples: 4
        warmup: 1
        iterations: 5
        configurations:
          - {name: clean, passes: [cleanup]}
          - {name: bad-shape, passes: [fix-shapes], options: {shape: ['nope:1x8']}}
    """)
    code = main(["sweep", str(model), "--config", str(cfg), "--ledger", str(tmp_path / "l.db"), "-q"])
    assert code == 4
    with open_ledger(tmp_path / "l.db", readonly=True) as ledger:
        rows = {r["name"]: r for r in ledger.rows()}
    assert rows["clean"]["status"] == "ok" and rows["clean"]["metrics"]["cosine_min"] == pytest.approx(1.0)
    assert rows["bad-shape"]["status"] == "failed" and "nope" in rows["bad-shape"]["error"]
    assert rows["bad-shape"]["metrics"] == {} and rows["bad-shape"]["pipeline"] == ["fix-shapes"]
    assert rows["baseline"]["settings"]["eval_data"] == "random:4:seed=0"
    code = main(["ledger", "list", "--ledger", str(tmp_path / "l.db"), "--failed"])
    assert "bad-shape  failed" in capsys.readouterr().out


def test_session_config_per_configuration(tmp_path):
    """session_config entries reach each configuration's ONNX Runtime session and the ledger: the top-level ones
    everywhere, a configuration's own added to them (one with an effect, session.load_model_format=ORT, makes only
    that configuration fail to load, as a failed row; the others are measured)."""
    sweep = parse_config({"session_config": {"session.intra_op.allow_spinning": 0},
                          "configurations": [{"name": "a", "passes": ["cse"]},
                                             {"name": "b", "passes": ["cse"], "session_config": {"x.y": True}}]}, "s")
    assert sweep.session_config == {"session.intra_op.allow_spinning": "0"}
    assert sweep.configurations[0].session_config == {"session.intra_op.allow_spinning": "0"}
    assert sweep.configurations[1].session_config == {"session.intra_op.allow_spinning": "0", "x.y": "true"}
    model = tmp_path / "m.onnx"
    small_model(model)
    cfg = write(tmp_path / "s.yaml", """
        eval_samples: 2
        warmup: 1
        iterations: 3
        session_config: {session.intra_op.allow_spinning: "0"}
        configurations:
          - {name: plain, passes: [cleanup]}
          - {name: ort-format, passes: [cleanup], session_config: {session.load_model_format: ORT}}
    """)
    code = main(["sweep", str(model), "--config", str(cfg), "--ledger", str(tmp_path / "l.db"), "-q"])
    assert code == 4
    with open_ledger(tmp_path / "l.db", readonly=True) as ledger:
        rows = {r["name"]: r for r in ledger.rows()}
    assert rows["plain"]["status"] == "ok" and rows["baseline"]["status"] == "ok"
    assert rows["plain"]["settings"]["session_config"] == {"session.intra_op.allow_spinning": "0"}
    assert rows["baseline"]["settings"]["session_config"] == {"session.intra_op.allow_spinning": "0"}
    assert rows["ort-format"]["status"] == "failed" and "ORT" in rows["ort-format"]["error"]
    assert rows["ort-format"]["settings"]["session_config"] == {"session.intra_op.allow_spinning": "0",
                                                                "session.load_model_format": "ORT"}


def test_task_metric_and_data_override(tmp_path, capsys, monkeypatch):
    model = tmp_path / "m.onnx"
    small_model(model)
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "eval.npz", x=rng.standard_normal((6, 1, 8)).astype(np.float32))
    np.savez(tmp_path / "other.npz", x=rng.standard_normal((3, 1, 8)).astype(np.float32))
    (tmp_path / "mymetric.py").write_text(textwrap.dedent("""
        import numpy as np
        def score(outputs, samples, reference):
            return {"agree": float(np.mean([np.allclose(o["z"], r["z"], atol=1e-3) for o, r in zip(outputs, reference)])),
                    "n": float(len(samples))}
    """))
    write(tmp_path / "s.yaml", """
        eval_data: eval.npz
        task_metric: mymetric:score
        warmup: 1
        iterations: 5
        configurations:
          - {name: clean, passes: [cleanup]}
          - {name: pruned, passes: [prune-structured], options: {ratio: 0.5, round-to: 1}}
    """)
    monkeypatch.chdir(tmp_path)  # mymetric:score is found from the current folder
    code = main(["sweep", "m.onnx", "--config", "s.yaml", "--ledger", "l.db", "-q"])
    assert code == 0
    with open_ledger(tmp_path / "l.db", readonly=True) as ledger:
        rows = {r["name"]: r for r in ledger.rows()}
        assert rows["clean"]["metrics"]["task.n"] == 6.0 and rows["clean"]["metrics"]["task_metric"] == 1.0
        first_hash = rows["clean"]["eval_hash"]
    code = main(["sweep", "m.onnx", "--config", "s.yaml", "--ledger", "l.db", "-q", "--eval-data", "other.npz"])
    assert code == 0
    with open_ledger(tmp_path / "l.db", readonly=True) as ledger:
        later = ledger.rows()[-3:]
    assert [r["name"] for r in later] == ["baseline", "clean", "pruned"]
    assert later[1]["metrics"]["task.n"] == 3.0 and later[1]["eval_hash"] != first_hash
    assert later[1]["settings"]["eval_data"] == str((tmp_path / "other.npz").resolve())


def test_bad_eval_data(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    small_model(model)
    cfg = write(tmp_path / "s.yaml", "configurations: [{name: a, passes: [cse]}]\n")
    np.savez(tmp_path / "e.npz", y=np.ones((2, 1, 8), np.float32))
    code = main(["sweep", str(model), "--config", str(cfg), "--ledger", str(tmp_path / "l.db"), "--eval-data", str(tmp_path / "e.npz")])
    assert code == 2 and "unknown input(s) ['y']" in capsys.readouterr().err
    code = main(["sweep", str(model), "--config", str(cfg), "--ledger", str(tmp_path / "l.db"), "--eval-data", "nomodule:fn"])
    assert code == 2 and "cannot import module 'nomodule'" in capsys.readouterr().err
    code = main(["sweep", str(model), "--config", str(cfg), "--executor", "local", "--address", "auto"])
    assert code == 2 and "--address and --workers need --executor ray" in capsys.readouterr().err


def test_executor_ray_without_ray(tmp_path, capsys, monkeypatch):
    model = tmp_path / "m.onnx"
    small_model(model)
    cfg = write(tmp_path / "s.yaml", "configurations: [{name: a, passes: [cse]}]\n")
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails, as without the extra
    code = main(["sweep", str(model), "--config", str(cfg), "--ledger", str(tmp_path / "l.db"), "--executor", "ray"])
    err = capsys.readouterr().err
    assert code == 7 and "pip install 'mograph[ray]'" in err and "Ray" in err
