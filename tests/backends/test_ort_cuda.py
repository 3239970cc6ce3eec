"""ONNX Runtime on CUDA as a backend: device parsing, the exit-7 paths, IO binding (on the CPU here),
CUDA-graph binding logic, placement (fallback and Memcpy nodes) read from real profiles.

The machine running CI has no GPU: the CUDA runs themselves are in the GPU tests at the end, which
skip unless ONNX Runtime has a working CUDA provider.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from mograph.backends import NotAvailableError, _ort_profile, check_device
from mograph.backends import ort as ort_backend
from mograph.cli import main
from mograph.errors import UsageError
from mograph.plugins import BUILTIN_PLUGINS

BERT = Path(ort_backend.__file__).resolve().parent.parent / "examples" / "bert-tiny.onnx"
FEEDS = {"input_ids": np.arange(16, dtype=np.int64).reshape(1, 16) % 100, "attention_mask": np.ones((1, 16), np.int64)}


@pytest.fixture(autouse=True)
def _only_core_plugins(monkeypatch):
    monkeypatch.setenv("MOGRAPH_BLOCK_PLUGINS", ",".join(m for m in BUILTIN_PLUGINS if m.startswith("mograph.passes")))
    monkeypatch.setenv("MOGRAPH_DISABLE_PLUGIN_AUTOLOAD", "1")


def _has_cuda() -> bool:
    return ort_backend.CUDA_PROVIDER in onnxruntime.get_available_providers()


@pytest.fixture
def no_cuda(monkeypatch):
    """ONNX Runtime says it has no CUDA provider (whatever this machine has)."""
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])


def test_parse_device():
    assert ort_backend.parse_device(None) == ("cpu", 0)
    assert ort_backend.parse_device("cpu") == ("cpu", 0)
    assert ort_backend.parse_device("CUDA") == ("cuda", 0)
    assert ort_backend.parse_device("cuda:3") == ("cuda", 3)
    for bad in ("gpu", "cuda:", "cuda:x", "cpu:1", "tpu:0"):
        with pytest.raises(UsageError, match="unknown device"):
            ort_backend.parse_device(bad)


def test_check_device_follows_the_backends_devices():
    ort = ort_backend.BACKEND
    assert check_device(ort, None) == {}
    assert check_device(ort, "cuda:1") == {"device": "cuda:1"}
    with pytest.raises(UsageError, match="runs on cpu, cuda"):
        check_device(ort, "tpu")

    class NoDevices:
        name = "plain"

    with pytest.raises(UsageError, match="does not"):
        check_device(NoDevices(), "cuda")


def test_no_cuda_provider_is_exit_7_naming_onnxruntime_gpu(no_cuda):
    with pytest.raises(NotAvailableError, match="pip install onnxruntime-gpu") as info:
        ort_backend.require_device("cuda")
    assert info.value.exit_code == 7
    with pytest.raises(NotAvailableError):
        ort_backend.make_session(str(BERT), device="cuda")
    with pytest.raises(NotAvailableError):
        ort_backend.BACKEND.make_runner(str(BERT), device="cuda")
    ort_backend.require_device("cpu")  # the CPU is always there


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", str(BERT), "--device", "cuda"],
        ["bench", str(BERT), "--device", "cuda", "--cuda-graph", "--profile"],
        ["validate", str(BERT), "--backend", "ort", "--device", "cuda"],
        ["diff", str(BERT), str(BERT), "--device", "cuda"],
        ["optimize", str(BERT), "--verify", "--device", "cuda"],
    ],
    ids=["bench", "bench-graph", "validate", "diff", "optimize-verify"],
)
def test_cli_exit_7_without_cuda(no_cuda, argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--json"]) == 7
    data = json.loads(capsys.readouterr().out)
    assert data["exit_code"] == 7 and "onnxruntime-gpu" in data["error"]
    assert not list(tmp_path.iterdir())  # optimize wrote nothing


def test_cuda_provider_that_does_not_start_is_exit_7(monkeypatch):
    """ONNX Runtime lists CUDA but the session falls back to the CPU (what missing cuDNN looks like)."""
    if _has_cuda():
        pytest.skip("this onnxruntime really has a CUDA provider")
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ort_backend, "_CUDA_LIBS", [])  # do not import torch here
    real = onnxruntime.InferenceSession

    def session(payload, sess_options=None, providers=None):
        assert providers[0][0] == "CUDAExecutionProvider" and providers[0][1]["use_tf32"] == "0"
        return real(payload, sess_options=sess_options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(onnxruntime, "InferenceSession", session)
    with pytest.raises(NotAvailableError, match="did not start"):
        ort_backend.make_session(str(BERT), device="cuda")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--device", "cuda", "--provider", "CPUExecutionProvider"], "not both"),
        (["--cuda-graph"], "needs --device cuda"),
        (["--device", "cuda", "--cuda-graph", "--no-io-binding"], "no-io-binding"),
        (["--device", "gpu"], "runs on cpu, cuda"),
        (["--top", "0", "--profile"], "at least 1"),
    ],
)
def test_bench_argument_errors(extra, message, capsys):
    assert main(["bench", str(BERT), *extra, "--iterations", "1", "--json"]) == 2
    assert message in json.loads(capsys.readouterr().out)["error"]


def test_other_commands_argument_errors(capsys):
    assert main(["validate", str(BERT), "--backend", "ort", "--cuda-graph", "--json"]) == 2
    assert "--cuda-graph" in json.loads(capsys.readouterr().out)["error"]
    assert main(["optimize", str(BERT), "--device", "tpu", "--json"]) == 2  # --device alone picks the recipe now
    assert "tpu" in json.loads(capsys.readouterr().out)["error"]
    assert main(["diff", str(BERT), str(BERT), "--device", "tpu", "--json"]) == 2


def test_io_binding_on_the_cpu_gives_the_plain_outputs():
    runner = ort_backend.BACKEND.make_runner(str(BERT), optimizations=False)
    plain = runner(FEEDS)
    step = runner.bind(FEEDS)
    step()
    step()
    bound = runner.outputs()
    assert list(bound) == list(plain) == ["last_hidden_state", "pooler_output"]
    for name in plain:
        np.testing.assert_array_equal(bound[name], plain[name])
    other = {k: (v + 1) % 100 if k == "input_ids" else v for k, v in FEEDS.items()}
    runner.bind(other)()
    assert not np.array_equal(runner.outputs()["last_hidden_state"], plain["last_hidden_state"])


def test_bench_io_binding_on_the_cpu(capsys):
    code = main(["bench", str(BERT), "--io-binding", "--json", "--warmup", "1", "--iterations", "3", "--threads", "1"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["io_binding"] is True and data["device"] == "cpu" and data["cuda_graph"] is False
    assert data["latency_ms"]["min"] > 0 and data["placement"] is None  # CPU runs are not placement-profiled
    assert main(["bench", str(BERT), "--warmup", "0", "--iterations", "2"]) == 0
    assert "run(feeds) (host copies included)" in capsys.readouterr().out


def test_graph_binding_logic_on_the_cpu():
    """The CUDA-graph path (output buffers from a probe run bound before the first run, same shapes only),
    run on the CPU: ONNX Runtime only captures on CUDA, but the binding is the same."""
    session = ort_backend.make_session(str(BERT), free_dims={"batch": 1, "seq": 16})
    specs = ort_backend.probe_outputs(session, ort_backend._zero_feeds(session, {k: v.shape for k, v in FEEDS.items()}))
    assert specs == {"last_hidden_state": ((1, 16, 64), np.float32), "pooler_output": ((1, 64), np.float32)}
    with pytest.raises(UsageError, match="needs its output shapes"):
        ort_backend.OrtRunner(session, device="cpu", cuda_graph=True)(FEEDS)
    runner = ort_backend.OrtRunner(session, device="cpu", cuda_graph=True, output_specs=specs)
    out = runner(FEEDS)
    plain = ort_backend.run(session, FEEDS)
    for name in plain:
        np.testing.assert_allclose(out[name], plain[name], rtol=1e-6, atol=1e-6)
    with pytest.raises(UsageError, match="captured for feeds"):
        runner.bind({k: np.concatenate([v, v], axis=1) for k, v in FEEDS.items()})
    with pytest.raises(UsageError, match="shape of every input"):
        ort_backend._zero_feeds(session, {"input_ids": (1, 16)})
    with pytest.raises(UsageError, match="needs the feeds' shapes"):
        ort_backend.OrtBackend._graph_runner(str(BERT), {}, False, None, "cuda", None)


def test_free_dims_from_the_model_and_the_feeds():
    assert ort_backend._free_dims(str(BERT), {"input_ids": (2, 32)}) == {"batch": 2, "seq": 32}
    from mograph import ir_io

    assert ort_backend._free_dims(ir_io.load_model(BERT), {"attention_mask": (1, 8)}) == {"batch": 1, "seq": 8}


def test_placement_from_a_real_cpu_profile():
    runner = ort_backend.BACKEND.make_runner(str(BERT), optimizations=False, placement=True)
    assert runner.placement is None and runner.profiling
    runner(FEEDS)
    assert not runner.profiling
    where = runner.placement
    assert where is not None and where["profiled"] is True
    assert where["provider"] == "CPUExecutionProvider"
    # every node of the graph as written ran once (optimizations off: no ORT fusions); Constant nodes are
    # folded into initializers at load, so they do not run
    import onnx

    proto = onnx.load(str(BERT))
    expected = sum(1 for n in proto.graph.node if n.op_type != "Constant")
    assert where["nodes"] == expected and where["by_provider"] == {"CPUExecutionProvider": expected}
    assert where["fallback"] == [] and where["memcpy"] == []
    runner(FEEDS)  # later runs are not profiled and change nothing
    assert runner.placement is where


def _real_profile(tmp_path: Path) -> list[dict]:
    session = ort_backend.make_session(str(BERT), profile_prefix=str(tmp_path / "p"))
    for _ in range(3):
        ort_backend.run(session, FEEDS)
    return _ort_profile.read_events(session.end_profiling())


def test_fallback_and_memcpy_parsing(tmp_path):
    events = _real_profile(tmp_path)
    as_cuda = _ort_profile.placement(events, "CUDAExecutionProvider")
    # read against CUDA, every node of this CPU profile is a fallback, named with its op type
    assert as_cuda["nodes"] == len(as_cuda["fallback"]) > 20
    assert all(f["provider"] == "CPUExecutionProvider" for f in as_cuda["fallback"])
    assert {"MatMul", "Softmax"} <= {f["op_type"] for f in as_cuda["fallback"]}
    # a copy node, as ONNX Runtime writes them between providers (one event of the real profile, retyped)
    last = _ort_profile.run_windows(events, 1)[0]
    node = next(e for e in events if e.get("cat") == "Node" and last[0] <= e["ts"] <= last[1])
    copy = {**node, "name": "Memcpy_token_kernel_time", "args": {**node["args"], "op_name": "MemcpyFromHost"}}
    seen = _ort_profile.placement([*events, copy], "CPUExecutionProvider")
    assert seen["memcpy"] == [{"name": "Memcpy_token", "op_type": "MemcpyFromHost", "provider": "CPUExecutionProvider"}]
    assert seen["fallback"] == [] and seen["nodes"] == as_cuda["nodes"] + 1
    assert _ort_profile.placement([], "CUDAExecutionProvider")["profiled"] is False


def test_node_times_use_the_last_runs(tmp_path):
    events = _real_profile(tmp_path)
    assert len(_ort_profile.run_windows(events)) == 3
    nodes, seen = _ort_profile.node_times(events, 2)
    assert seen == 2 and all(n["calls"] == 1 and n["ms"] >= 0 for n in nodes)
    assert _ort_profile.kernel_times(events) == []  # CPU profiles hold no kernel events
    fake = [*events, {"cat": "Kernel", "name": "k", "ts": 1, "dur": 3000}]
    assert _ort_profile.kernel_times(fake, 3) == [{"name": "k", "ms": 1.0, "count": 1}]


# ---- on a GPU ------------------------------------------------------------------------------------

def _cuda_works() -> bool:
    if not _has_cuda():
        return False
    try:
        ort_backend.make_session(str(BERT), device="cuda")
    except Exception:  # noqa: BLE001
        return False
    return True


gpu = pytest.mark.skipif(not _cuda_works(), reason="needs onnxruntime-gpu with a working CUDA provider and a GPU")


@gpu
def test_gpu_bench_io_binding_and_cuda_graph(capsys):
    assert main(["bench", str(BERT), "--device", "cuda", "--json", "--iterations", "5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["io_binding"] is True and data["providers"][0] == "CUDAExecutionProvider"
    assert data["placement"]["profiled"] is True
    code = main(["bench", str(BERT), "--device", "cuda", "--cuda-graph", "--json", "--iterations", "5"])
    data = json.loads(capsys.readouterr().out)
    # bert-tiny's shape subgraph folds once its dims are pinned, or ORT refuses the graph, naming CPU nodes
    assert (code == 0 and data["cuda_graph"] is True) or (code == 2 and "CPU" in data["error"])


@gpu
def test_gpu_validate_against_the_cpu(capsys):
    assert main(["validate", str(BERT), "--backend", "ort", "--device", "cuda", "--json", "--atol", "1e-3",
                 "--rtol", "1e-2"]) == 0


@pytest.mark.parametrize(
    "numeric, tf32, off",
    [(True, None, True), (False, None, False), (False, False, True), (True, True, False)],
)
def test_tf32_choice_reaches_the_cuda_provider(numeric, tf32, off):
    """numeric checks turn TF32 off unless told; deployed runs keep ONNX Runtime's default unless told."""
    _, options = ort_backend._cuda_provider(0, cuda_graph=False, numeric=numeric, tf32=tf32)
    assert (options.get("use_tf32") == "0") is off


def test_validate_tf32_needs_cuda(capsys):
    assert main(["validate", str(BERT), "--backend", "ort", "--tf32", "--json"]) == 2
    assert "--tf32 needs --backend ort --device cuda" in json.loads(capsys.readouterr().out)["error"]
