"""``--executor ray``: a Ray cluster on loopback builds a sweep's configurations and runs the sensitivity
analysis; the results equal the local ones.  Skipped when Ray is not installed (``pip install 'mograph[ray]'``)."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mograph.cli import main
from mograph.errors import UsageError
from mograph.workflow.ledger import open_ledger

# Ray's token authentication: a throwaway token for the throwaway cluster below.  Ray reads it when it is
# first imported, so it is set before that, for this driver and (inherited) for the cluster's processes.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
ray = pytest.importorskip("ray")

sys.path.insert(0, str(Path(__file__).parent))
from test_sweep import small_model, write  # noqa: E402

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A two-CPU Ray head on 127.0.0.1, started with ``ray start --block`` and stopped by its process id
    (never ``ray stop``, which would stop every Ray instance of this user on the machine)."""
    port = _free_port()
    temp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    ray_cli = Path(sys.executable).with_name("ray")
    proc = subprocess.Popen(
        [str(ray_cli), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", f"--port={port}",
         "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats", f"--temp-dir={temp}"],
        env=env, stdout=open(temp / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if proc.poll() is not None:
                pytest.fail("ray start exited early")
            time.sleep(0.5)
    time.sleep(2)
    yield address
    if ray.is_initialized():
        ray.shutdown()
    os.killpg(proc.pid, 15)  # the group ray start --block leads: its raylet, GCS and workers
    try:
        proc.wait(timeout=90)  # it drains for up to 30 s
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)


def _square(x: int) -> int:
    return x * x


def _refuse(x: int) -> int:
    raise UsageError(f"no {x}")


def test_ray_map(cluster):
    from mograph.workflow.executors import make_executor

    with make_executor("ray", address=cluster) as ex:
        assert ex.width == 2
        assert ex.map(_square, list(range(7))) == [x * x for x in range(7)]
        with pytest.raises(UsageError, match="no 3"):
            ex.map(_refuse, [3])


def test_sweep_on_ray_equals_local(cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = tmp_path / "m.onnx"
    small_model(model)
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(5).standard_normal((8, 1, 8)).astype(np.float32))
    cfg = write(tmp_path / "s.yaml", """
        eval_samples: 4
        calibration_data: calib.npz
        warmup: 1
        iterations: 5
        configurations:
          - {name: clean, passes: [cleanup]}
          - {name: pruned, passes: [prune-structured], options: {ratio: 0.5, round-to: 1}}
          - {name: bad, passes: [fix-shapes], options: {shape: ['nope:1x8']}}
    """)
    local, remote = tmp_path / "local.db", tmp_path / "ray.db"
    assert main(["sweep", str(model), "--config", str(cfg), "--ledger", str(local), "-q"]) == 4
    assert main(["sweep", str(model), "--config", str(cfg), "--ledger", str(remote), "-q",
                 "--executor", "ray", "--address", cluster]) == 4
    with open_ledger(local, readonly=True) as a, open_ledger(remote, readonly=True) as b:
        ra, rb = a.rows(), b.rows()
    assert [r["name"] for r in ra] == [r["name"] for r in rb] == ["baseline", "clean", "pruned", "bad"]
    for x, y in zip(ra, rb):
        assert x["status"] == y["status"] and x["pipeline"] == y["pipeline"]
        assert x["settings"].get("output_hash") == y["settings"].get("output_hash")  # the very same built models
        for key in ("size_bytes", "cosine_mean", "cosine_min", "max_abs"):
            assert x["metrics"].get(key) == y["metrics"].get(key)
    assert rb[1]["settings"]["executor"].startswith("ray (127.0.0.1:")
    assert "nope" in rb[3]["error"]


def test_sensitivity_on_ray_equals_local(cluster, monkeypatch):
    """The sensitivity analysis of qdq-int8 --accuracy-budget: over Ray (width 2) the same layers are kept as
    in one process, and the evaluations ran as Ray tasks."""
    from mograph import api
    from mograph.cli._common import example_path
    from mograph.workflow.executors import RayExecutor, use_executor

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    src = example_path("bert-tiny")
    options = {"calibration_data": str(src.with_suffix(".npz")), "accuracy_budget": "max-abs<=0.001"}

    def plan_keep(report):
        for p in report.passes:
            if p.name == "qdq-int8":
                return p.stats, p.details["plan"]
        raise AssertionError("no qdq-int8 pass")

    _, local = api.optimize(src, ["qdq-int8"], options=options)
    calls = []
    with RayExecutor(cluster) as ex:
        inner = ex.as_map()

        def counting(fn, items):
            calls.append(len(items))
            return inner(fn, items)

        counting.width = inner.width  # type: ignore[attr-defined]
        with use_executor(counting):  # type: ignore[arg-type]
            _, remote = api.optimize(src, ["qdq-int8"], options=options)
    stats_l, plan_l = plan_keep(local)
    stats_r, plan_r = plan_keep(remote)
    evals_l = plan_l["accuracy_budget"].pop("evaluations")
    plan_r["accuracy_budget"].pop("evaluations")
    for plan in (plan_l, plan_r):
        plan["accuracy_budget"].pop("metric_by_kept_float")  # the points a wider search measured differ
    stats_l.pop("sensitivity_evaluations")
    stats_r.pop("sensitivity_evaluations")
    assert 0 < stats_l["kept_float"] < stats_l["kept_float"] + stats_l["quantized"]  # the search had work to do
    assert plan_l == plan_r and stats_l == stats_r  # the same layers kept, the same measured figure
    assert max(calls) == 2  # two mixes evaluated per round, as Ray tasks
    assert len(calls) < evals_l  # fewer rounds than the serial search's evaluations


def test_ray_bad_address(capsys, tmp_path):
    from mograph.workflow.executors import make_executor

    with pytest.raises(UsageError, match="cannot join the Ray cluster"):
        make_executor("ray", address=f"127.0.0.1:{_free_port()}")
