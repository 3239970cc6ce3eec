"""The TensorRT backend: engine builds (with the mograph plugins) on the CPU through tensorrt_rtx.

What runs where:

* everything here runs on a machine without a GPU; tests that need a TensorRT module skip, with the
  reason, when neither ``tensorrt`` nor ``tensorrt_rtx`` is importable;
* models with plugin nodes are parsed only in child processes (:func:`plugin_builds`): with the 1.7.1 RTX
  wheels a missed workaround of the plugin-library trap aborts the whole process, and it must not take
  pytest with it. One child builds the plugin chain and the fused BERT-style model in the default mode, then
  the chain again with the fix forced into its own grandchild process (``MOGRAPH_TRT_LIB_FIX=subprocess-always``);
* the plugin classes' build-time methods (fields, shapes, formats, enqueue's call of ``launch``) are called
  directly in this process; the kernels themselves run in ``test_trt_plugins_gpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph.backends import _trt_loader
from mograph.backends import tensorrt as trt_backend
from mograph.backends.tensorrt_plugins import (
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    PLUGINS,
    launch,
    plugin_attributes,
    plugin_for_op,
)
from mograph.errors import BackendUnavailableError, ModelError, PluginError, UsageError

ROOT = Path(__file__).resolve().parents[2]

TRT_NAME = _trt_loader.find_trt_module()
needs_trt = pytest.mark.skipif(TRT_NAME is None, reason="neither tensorrt nor tensorrt_rtx is installed")
HIDDEN = 64


# ------------------------------------------------------------------------------------------------ models


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def plugin_chain_model(hidden: int = HIDDEN) -> onnx.ModelProto:
    """x[batch, hidden] -> MatMul -> LayerNorm -> Gelu(tanh) -> y."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="/proj/MatMul"),
        helper.make_node(
            "LayerNorm",
            ["m", "gamma", "beta"],
            ["ln"],
            name="/ln/LayerNorm",
            domain="mograph",
            **plugin_attributes("LayerNorm", epsilon=1e-12),
        ),
        helper.make_node(
            "Gelu", ["ln"], ["y"], name="/act/Gelu", domain="mograph", **plugin_attributes("Gelu", approximate="tanh")
        ),
    ]
    inits = [
        _init("w", rng.normal(0, 0.02, (hidden, hidden)).astype(np.float32)),
        _init("gamma", (1 + rng.normal(0, 0.1, hidden)).astype(np.float32)),
        _init("beta", rng.normal(0, 0.1, hidden).astype(np.float32)),
    ]
    graph = helper.make_graph(
        nodes,
        "plugin_chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", hidden])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("mograph", 1)])


def fused_bert_model(
    layers: int = 2, hidden: int = HIDDEN, heads: int = 4, ffn: int = 128, vocab: int = 100
) -> onnx.ModelProto:
    """A BERT encoder as ``--target tensorrt`` fusion leaves it: the norms and GELUs are mograph plugin nodes.

    embeddings: Gather(word) + Slice(position table) -> LayerNorm; per layer: attention (MatMul/Reshape/
    Transpose/Softmax) -> output MatMul -> SkipLayerNorm(+bias) ; FFN MatMul -> BiasGelu ->
    MatMul -> SkipLayerNorm(+bias). Dynamic batch and sequence. Plugin layers: 1 + 3 * layers.
    """
    rng = np.random.default_rng(1)
    hd = hidden // heads
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def w(name: str, shape: tuple[int, ...], scale: float = 0.02) -> str:
        inits.append(_init(name, rng.normal(0, scale, shape).astype(np.float32)))
        return name

    def const(name: str, value: np.ndarray) -> str:
        inits.append(_init(name, value))
        return name

    def node(op: str, ins: list[str], out: str, domain: str = "", **attrs: object) -> str:
        nodes.append(helper.make_node(op, ins, [out], name=f"/{out}/{op}", domain=domain, **attrs))
        return out

    def gamma(prefix: str) -> tuple[str, str]:
        g = const(f"{prefix}.weight", (1 + rng.normal(0, 0.05, hidden)).astype(np.float32))
        b = const(f"{prefix}.bias", rng.normal(0, 0.05, hidden).astype(np.float32))
        return g, b

    word = node("Gather", [w("embeddings.word_embeddings.weight", (vocab, hidden)), "input_ids"], "word")
    shape = node("Shape", ["input_ids"], "ids_shape")
    seq = node("Slice", [shape, const("c1", np.array([1])), const("c2", np.array([2]))], "seq_len")
    pos = node(
        "Slice",
        [
            w("embeddings.position_embeddings.weight", (1, 128, hidden)),
            const("c0", np.array([0])),
            seq,
            const("c1b", np.array([1])),
        ],
        "pos",
    )
    emb = node("Add", [word, pos], "emb_sum")
    g, b = gamma("embeddings.LayerNorm")
    x = node("LayerNorm", [emb, g, b], "emb", "mograph", **plugin_attributes("LayerNorm", epsilon=1e-12))
    to_heads = const("to_heads", np.array([0, 0, heads, hd], dtype=np.int64))
    to_hidden = const("to_hidden", np.array([0, 0, hidden], dtype=np.int64))
    scale = const("scale", np.array(1.0 / np.sqrt(hd), dtype=np.float32))
    for i in range(layers):
        p = f"encoder.layer.{i}"
        split = []
        for name in ("query", "key", "value"):
            mm = node("MatMul", [x, w(f"{p}.attention.self.{name}.weight", (hidden, hidden))], f"l{i}_{name}_mm")
            add = node("Add", [mm, w(f"{p}.attention.self.{name}.bias", (hidden,))], f"l{i}_{name}")
            r = node("Reshape", [add, to_heads], f"l{i}_{name}_heads")
            split.append(node("Transpose", [r], f"l{i}_{name}_t", perm=[0, 2, 1, 3]))
        q, k, v = split
        kt = node("Transpose", [k], f"l{i}_kT", perm=[0, 1, 3, 2])
        scores = node("Mul", [node("MatMul", [q, kt], f"l{i}_qk"), scale], f"l{i}_scores")
        probs = node("Softmax", [scores], f"l{i}_probs", axis=-1)
        ctx = node("Transpose", [node("MatMul", [probs, v], f"l{i}_ctx_h")], f"l{i}_ctx_t", perm=[0, 2, 1, 3])
        ctx = node("Reshape", [ctx, to_hidden], f"l{i}_ctx")
        attn = node("MatMul", [ctx, w(f"{p}.attention.output.dense.weight", (hidden, hidden))], f"l{i}_attn")
        g, b = gamma(f"{p}.attention.output.LayerNorm")
        bias = w(f"{p}.attention.output.dense.bias", (hidden,))
        h1 = node(
            "SkipLayerNorm",
            [attn, x, g, b, bias],
            f"l{i}_h1",
            "mograph",
            **plugin_attributes("SkipLayerNorm", epsilon=1e-12),
        )
        ff = node("MatMul", [h1, w(f"{p}.intermediate.dense.weight", (hidden, ffn))], f"l{i}_ff")
        act = node(
            "BiasGelu",
            [ff, w(f"{p}.intermediate.dense.bias", (ffn,))],
            f"l{i}_act",
            "mograph",
            **plugin_attributes("BiasGelu"),
        )
        ff2 = node("MatMul", [act, w(f"{p}.output.dense.weight", (ffn, hidden))], f"l{i}_ff2")
        g, b = gamma(f"{p}.output.LayerNorm")
        bias = w(f"{p}.output.dense.bias", (hidden,))
        if i < layers - 1:
            x = node(
                "SkipLayerNorm",
                [ff2, h1, g, b, bias],
                f"l{i}_out",
                "mograph",
                **plugin_attributes("SkipLayerNorm", epsilon=1e-12),
            )
        else:  # the last one also returns its residual sum (second output, sum_output=1)
            attrs = plugin_attributes("SkipLayerNorm", epsilon=1e-12, sum_output=1)
            nodes.append(
                helper.make_node(
                    "SkipLayerNorm",
                    [ff2, h1, g, b, bias],
                    [f"l{i}_out", "residual_sum"],
                    name=f"/l{i}_out/SkipLayerNorm",
                    domain="mograph",
                    **attrs,
                )
            )
            x = f"l{i}_out"
    nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"], name="/output/Identity"))
    graph = helper.make_graph(
        nodes,
        "fused_bert",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [
            helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "seq", hidden]),
            helper.make_tensor_value_info("residual_sum", TensorProto.FLOAT, ["batch", "seq", hidden]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("mograph", 1)])


def native_layernorm_model(hidden: int = HIDDEN) -> onnx.ModelProto:
    """Opset 17 ``LayerNormalization`` (TensorRT's own normalization layer), then the ONNX ``Gelu``-free Erf form."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-1, epsilon=1e-5, name="ln"),
        helper.make_node("Div", ["ln", "sqrt2"], ["d"], name="div"),
        helper.make_node("Erf", ["d"], ["e"], name="erf"),
        helper.make_node("Add", ["e", "one"], ["a"], name="add"),
        helper.make_node("Mul", ["ln", "a"], ["m"], name="mul"),
        helper.make_node("Mul", ["m", "half"], ["y"], name="mul_half"),
    ]
    inits = [
        _init("g", (1 + rng.normal(0, 0.1, hidden)).astype(np.float32)),
        _init("b", rng.normal(0, 0.1, hidden).astype(np.float32)),
        _init("sqrt2", np.array(np.sqrt(2.0), dtype=np.float32)),
        _init("one", np.array(1.0, dtype=np.float32)),
        _init("half", np.array(0.5, dtype=np.float32)),
    ]
    graph = helper.make_graph(
        nodes,
        "native_ln",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", hidden])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# ------------------------------------------------------------------------------------ without TensorRT


def test_import_is_lazy_and_missing_trt_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    monkeypatch.setattr(_trt_loader, "_cached", None)
    assert _trt_loader.find_trt_module() is None
    assert not trt_backend.BACKEND.available()
    with pytest.raises(BackendUnavailableError) as info:
        trt_backend.build_engine(
            native_layernorm_model(), tmp_path / "m.engine", profiles={"x": "1x4x64,2x8x64,4x16x64"}
        )
    assert "mograph[tensorrt]" in str(info.value) and info.value.exit_code == 7
    assert not (tmp_path / "m.engine").exists()


def test_module_imports_nothing_heavy():
    code = (
        "import sys, mograph.backends.tensorrt, mograph.backends.tensorrt_plugins, mograph.cli.build, mograph.cli.validate\n"
        "bad = [m for m in ('tensorrt', 'tensorrt_rtx', 'cuda', 'torch', 'polygraphy', 'onnxruntime') if m in sys.modules]\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_plugin_table_is_the_contract():
    assert set(PLUGINS) == {"LayerNorm", "RMSNorm", "SkipLayerNorm", "SkipRMSNorm", "Gelu", "BiasGelu"}
    assert plugin_for_op("LayerNorm") is PLUGINS["LayerNorm"] is plugin_for_op("LayerNorm")
    attrs = plugin_attributes("SkipLayerNorm", epsilon=1e-12)
    assert attrs == {"epsilon": 1e-12, "sum_output": 0, "plugin_namespace": "mograph", "plugin_version": "1"}
    assert plugin_attributes("Gelu") == {"approximate": "none", "plugin_namespace": "mograph", "plugin_version": "1"}
    with pytest.raises(PluginError, match="unknown attribute"):
        plugin_attributes("Gelu", epsilon=1.0)
    with pytest.raises(PluginError, match="no mograph TensorRT plugin"):
        plugin_for_op("Softmax")


def test_launch_checks_arguments_before_touching_the_gpu():
    with pytest.raises(PluginError, match="takes 2..3 inputs"):
        launch("LayerNorm", {}, [1], [2], [(4, 8)], "float32")
    with pytest.raises(PluginError, match="2 output"):
        launch("SkipLayerNorm", {"sum_output": 1}, [1, 2, 3], [4], [(4, 8), (4, 8), (8,)], "float16")
    with pytest.raises(PluginError, match="Scale must have 8 elements"):
        launch("RMSNorm", {}, [1, 2], [3], [(4, 8), (7,)], "float32")
    with pytest.raises(PluginError, match="float32, float16 or bfloat16"):
        launch("Gelu", {}, [1], [2], [(4, 8)], "int8")
    with pytest.raises(PluginError, match="approximate"):
        launch("Gelu", {"approximate": "fast"}, [1], [2], [(4, 8)], "float32")
    launch("Gelu", {}, [1], [2], [(0, 8)], "float32", lib=object())  # empty tensor: nothing to launch


@pytest.mark.slow  # where no library is built yet, it compiles the kernels (minutes): not in the quick run
def test_launch_reports_kernel_status(request, monkeypatch):
    """A NULL pointer is refused by the library itself (no CUDA call), on any machine: the status comes back as an error.

    Where the library is not built yet but nvcc is there (CI), the run's one fresh build (the session fixture
    ``kernel_library`` in ``tests/conftest.py``) is used.
    """
    from mograph.backends.tensorrt_plugins import KERNELS_ENV, kernel_library_path, load_kernels

    if not kernel_library_path().exists():
        monkeypatch.setenv(KERNELS_ENV, str(request.getfixturevalue("kernel_library")))
    lib = load_kernels()
    with pytest.raises(PluginError, match="status 1"):
        launch("LayerNorm", {"epsilon": 1e-5}, [0, 0], [0], [(4, 64), (64,)], "float32", 0, lib=lib)
    with pytest.raises(PluginError, match="status 1"):
        launch("BiasGelu", {"approximate": "tanh"}, [0, 0], [0], [(4, 64), (64,)], "bfloat16", 0, lib=lib)


def test_backend_is_registered():
    from mograph.plugins import get_registry, reset

    reset()
    backends = get_registry().backends
    assert backends["tensorrt"] is trt_backend.BACKEND
    assert trt_backend.BACKEND.available() == (TRT_NAME is not None)


# ----------------------------------------------------------------------------- with TensorRT, in process


@pytest.fixture(scope="module")
def trt():
    if TRT_NAME is None:
        pytest.skip("neither tensorrt nor tensorrt_rtx is installed")
    return _trt_loader.import_trt()


def test_plugins_register_once_and_round_trip_their_fields(trt):
    from mograph.backends.tensorrt_plugins import register_plugins

    names = register_plugins(trt)
    assert register_plugins(trt) == names == list(PLUGINS)
    registry = trt.get_plugin_registry()
    for name in names:
        creator = registry.get_creator(name, PLUGIN_VERSION, PLUGIN_NAMESPACE)
        assert creator is not None, name
    creator = registry.get_creator("SkipLayerNorm", "1", "mograph")
    fc = trt.PluginFieldCollection(
        [
            trt.PluginField("epsilon", np.array([1e-12], np.float32), trt.PluginFieldType.FLOAT32),
            trt.PluginField("sum_output", np.array([1], np.int32), trt.PluginFieldType.INT32),
        ]
    )
    plugin = creator.create_plugin("n", fc, trt.TensorRTPhase.BUILD)
    assert plugin.num_outputs == 2 and plugin.plugin_namespace == "mograph"
    again = creator.create_plugin("n", plugin.get_fields_to_serialize(), trt.TensorRTPhase.RUNTIME)
    assert again.attrs == plugin.attrs == {"epsilon": pytest.approx(1e-12), "sum_output": 1}
    gelu = registry.get_creator("Gelu", "1", "mograph")
    chars = np.frombuffer(b"tanh\0", dtype=np.int8)
    g = gelu.create_plugin(
        "g",
        trt.PluginFieldCollection([trt.PluginField("approximate", chars, trt.PluginFieldType.CHAR)]),
        trt.TensorRTPhase.BUILD,
    )
    g2 = gelu.create_plugin("g", g.get_fields_to_serialize(), trt.TensorRTPhase.RUNTIME)
    assert g2.attrs == {"approximate": "tanh"}
    assert g.clone().attrs == g.attrs and g.attach_to_context(None).attrs == g.attrs


def test_plugin_types_formats_and_enqueue_call_launch(trt, monkeypatch):
    from mograph.backends import tensorrt_plugins

    tensorrt_plugins.register_plugins(trt)
    creator = trt.get_plugin_registry().get_creator("LayerNorm", "1", "mograph")
    plugin = creator.create_plugin("ln", trt.PluginFieldCollection([]), trt.TensorRTPhase.RUNTIME)
    assert plugin.attrs == {"epsilon": 1e-5}
    assert plugin.get_output_data_types([trt.DataType.HALF, trt.DataType.HALF]) == [trt.DataType.HALF]

    def desc(dtype, shape=(2, 3, 64)):
        d = trt.PluginTensorDesc()
        d.dims = trt.Dims(shape)
        d.type = dtype
        d.format = trt.TensorFormat.LINEAR
        return d

    def dyn(dtype):
        d = trt.DynamicPluginTensorDesc()
        d.desc = desc(dtype)
        return d

    f32, f16, bf16 = trt.DataType.FLOAT, trt.DataType.HALF, trt.DataType.BF16
    assert plugin.supports_format_combination(0, [dyn(f16), dyn(f16), dyn(f16)], 2)
    assert plugin.supports_format_combination(0, [dyn(bf16), dyn(bf16), dyn(bf16)], 2)
    assert plugin.supports_format_combination(2, [dyn(f32), dyn(f32), dyn(f32)], 2)
    assert not plugin.supports_format_combination(1, [dyn(f32), dyn(f16), dyn(f32)], 2)
    assert not plugin.supports_format_combination(0, [dyn(trt.DataType.INT8)] * 3, 2)

    calls = []
    monkeypatch.setattr(tensorrt_plugins, "launch", lambda *a, **k: calls.append(a))
    plugin.enqueue([desc(f16), desc(f16, (64,)), desc(f16, (64,))], [desc(f16)], [11, 12, 13], [21], 0, 99)
    assert calls == [("LayerNorm", {"epsilon": 1e-5}, [11, 12, 13], [21], [(2, 3, 64), (64,), (64,)], "float16", 99)]


def test_native_layernorm_model_builds(trt, tmp_path):
    out = tmp_path / "ln.engine"
    report = trt_backend.build_engine(
        native_layernorm_model(), out, profiles={"x": ((1, 1, 64), (2, 16, 64), (8, 128, 64))}
    )
    assert out.stat().st_size == report["engine_bytes"] > 0
    assert report["plugin_layers"] == [] and report["unsupported"] == [] and not report["subprocess"]
    assert report["module"] == TRT_NAME
    assert report["profiles"] == {"x": [[1, 1, 64], [2, 16, 64], [8, 128, 64]]}
    assert report["layer_types"].get("NORMALIZATION", 0) >= 1


def test_unfused_bert_builds_with_profiles_from_metadata(trt, tmp_path):
    from models.builders import bert_tiny

    try:
        from mograph.passes.shape.profiles import write_profiles
    except ImportError:
        pytest.skip("mograph.passes.shape.profiles is not there yet")
    from mograph import ir_io

    model = ir_io.load_model(bert_tiny())
    prof = ((1, 4), (2, 16), (4, 64))
    write_profiles(model, {"input_ids": prof, "attention_mask": prof})
    report = trt_backend.build_engine(model, tmp_path / "bert.engine")
    assert report["profiles"] == {"input_ids": [[1, 4], [2, 16], [4, 64]], "attention_mask": [[1, 4], [2, 16], [4, 64]]}
    assert report["engine_bytes"] > 100_000 and report["layers"] > 100


def test_dynamic_input_without_profile_is_built_for_a_default_shape(trt, tmp_path, caplog):
    from models.builders import bert_tiny

    with caplog.at_level("WARNING", logger="mograph.backends.tensorrt"):
        report = trt_backend.build_engine(bert_tiny(), tmp_path / "bert.engine", shapes=["input_ids:2x16"])
    assert report["profiles"]["input_ids"] == [[2, 16]] * 3
    assert report["profiles"]["attention_mask"] == [[2, 16]] * 3  # shares batch and seq with input_ids
    assert report["defaulted_profiles"] == ["attention_mask", "input_ids"]
    assert any("'attention_mask'" in r.message and "fixed shape 2x16" in r.message for r in caplog.records)
    (tmp_path / "bert.engine").unlink()
    with pytest.raises(UsageError, match="no input of"):
        trt_backend.build_engine(
            native_layernorm_model(), tmp_path / "x.engine", profiles={"y": "1x1x64,1x1x64,1x1x64"}
        )
    with pytest.raises(UsageError, match="does not fit"):
        trt_backend.build_engine(
            native_layernorm_model(), tmp_path / "x.engine", profiles={"x": "1x1x32,1x1x32,1x1x32"}
        )
    assert not list(tmp_path.iterdir())


def test_precision_flags_are_reported_not_fatal(trt, tmp_path):
    report = trt_backend.build_engine(
        native_layernorm_model(), tmp_path / "p.engine", fp16=True, int8=True, profiles=["x:1x1x64,2x8x64,4x16x64"]
    )
    if _trt_loader.is_rtx(trt):
        assert report["precision"]["fp16"].startswith("not applied: tensorrt_rtx builds strongly typed networks")
        assert report["precision"]["int8"].startswith("not applied")
        assert any(n.startswith("--fp16 not applied") for n in report["notes"])
    else:
        assert report["precision"]["fp16"] == "on"


def test_bad_model_is_a_model_error(trt, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelError):
        trt_backend.build_engine(bad, tmp_path / "bad.engine")


@pytest.mark.skipif(trt_backend.gpu_status()[0], reason="this machine has a GPU")
def test_load_engine_without_gpu_says_why(trt, tmp_path):
    out = tmp_path / "ln.engine"
    trt_backend.build_engine(native_layernorm_model(), out, profiles={"x": "1x1x64,1x4x64,1x8x64"})
    with pytest.raises(trt_backend.CannotRunError, match="no NVIDIA GPU|no usable GPU|sees no GPU") as info:
        trt_backend.load_engine(out)
    assert info.value.exit_code == 7


# ------------------------------------------------------------------- with plugin nodes, in child processes

_CHILD = textwrap.dedent(
    """
    import json, os, sys
    from mograph.backends.tensorrt import build_engine, EngineBuildError
    folder = sys.argv[1]
    out = {}
    chain = {"x": ((1, 64), (8, 64), (64, 64))}
    bert = {"input_ids": ((1, 1), (2, 16), (4, 128))}
    out["chain"] = build_engine(os.path.join(folder, "chain.onnx"), os.path.join(folder, "chain.engine"), profiles=chain)
    out["bert"] = build_engine(os.path.join(folder, "bert.onnx"), os.path.join(folder, "bert.engine"), profiles=bert)
    try:
        build_engine(os.path.join(folder, "unknown.onnx"), os.path.join(folder, "unknown.engine"))
    except EngineBuildError as exc:
        out["unknown"] = {"message": str(exc), "unsupported": exc.report["unsupported"]}
    try:
        build_engine(os.path.join(folder, "scalar_beta.onnx"), os.path.join(folder, "scalar_beta.engine"))
    except EngineBuildError as exc:
        out["scalar_beta"] = {"message": str(exc), "problems": exc.report.get("plugin_node_problems")}
    from mograph.plugins import get_registry
    out["canonical"] = build_engine(os.path.join(folder, "canonical.onnx"), os.path.join(folder, "canonical.engine"),
                                    registry=get_registry())
    out["skip_rms"] = build_engine(os.path.join(folder, "skip_rms.onnx"), os.path.join(folder, "skip_rms.engine"))
    try:
        build_engine(os.path.join(folder, "beta_input.onnx"), os.path.join(folder, "beta_input.engine"))
    except EngineBuildError as exc:
        out["beta_input"] = {"message": str(exc), "problems": exc.report.get("plugin_node_problems")}
    os.environ["MOGRAPH_TRT_LIB_FIX"] = "subprocess-always"
    out["chain_child"] = build_engine(os.path.join(folder, "chain.onnx"), os.path.join(folder, "chain2.engine"), profiles=chain)
    print("RESULT " + json.dumps(out))
    """
)


def unknown_op_model() -> onnx.ModelProto:
    model = plugin_chain_model()
    model.graph.node[2].op_type = "MographNoSuchOp"
    model.graph.node.append(helper.make_node("NotAnOnnxOp", ["y"], ["z"], name="/odd/NotAnOnnxOp", domain="vendor"))
    model.graph.output[0].name = "z"
    model.opset_import.append(helper.make_opsetid("vendor", 1))
    return model


def scalar_beta_model(hidden: int = HIDDEN, beta_as_input: bool = False, canonical: bool = False) -> onnx.ModelProto:
    """A SkipLayerNorm plugin node whose B has one element and whose unread Sum output is still there: not the
    form the plugin takes, so the backend refuses it, naming the node (it validates, it does not legalize).
    ``canonical``: the same as a ``mograph.SkipLayerNorm`` op (no plugin attributes), which the backend lowers
    for TensorRT first, into a legal plugin node."""
    if canonical:
        node = helper.make_node("SkipLayerNorm", ["x", "s", "g", "b0", "b0"], ["y", "unused_sum"],
                                name="/sln/SkipLayerNorm", domain="mograph", epsilon=1e-5)
    else:
        node = helper.make_node("SkipLayerNorm", ["x", "s", "g", "b0"], ["y", "unused_sum"], name="/sln/SkipLayerNorm",
                                domain="mograph", epsilon=1e-5, plugin_namespace="mograph", plugin_version="1")
    nodes = [node]
    inits = [_init("g", np.ones(hidden, np.float32))]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, hidden]) for n in ("x", "s", "y")]
    inputs = io[:2]
    if beta_as_input:
        inputs.append(helper.make_tensor_value_info("b0", TensorProto.FLOAT, [1]))
    else:
        inits.append(_init("b0", np.zeros(1, np.float32)))
    graph = helper.make_graph(nodes, "scalar_beta", inputs, io[2:], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("mograph", 1)])


def skip_rms_model(hidden: int = HIDDEN) -> onnx.ModelProto:
    """A LLaMA-style residual Add and RMSNorm (decomposed), the sum also read on, fused for TensorRT."""
    import mograph

    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Add", ["h", "res"], ["s"]),
        helper.make_node("Pow", ["s", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["r"]),
        helper.make_node("Reciprocal", ["r"], ["ri"]),
        helper.make_node("Mul", ["s", "ri"], ["n"]),
        helper.make_node("Mul", ["gamma", "n"], ["y"]),
        helper.make_node("Mul", ["s", "two"], ["s2"]),
    ]
    inits = [_init("two", np.array(2.0, np.float32)), _init("axes", np.array([-1], np.int64)),
             _init("eps", np.array(1e-6, np.float32)),
             _init("gamma", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 8, hidden]) for n in ("h", "res", "y", "s2")]
    graph = helper.make_graph(nodes, "skip_rms", io[:2], io[2:], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    fused, report = mograph.optimize(proto, "fuse-rmsnorm,fuse-skip-layernorm", options={"target": "tensorrt"})
    assert report.passes[1].stats["SkipRMSNormFusion"] == 1, report.passes[1].stats
    return fused


@pytest.fixture(scope="module")
def plugin_builds(tmp_path_factory):
    if TRT_NAME is None:
        pytest.skip("neither tensorrt nor tensorrt_rtx is installed")
    folder = tmp_path_factory.mktemp("plugins")
    onnx.save(plugin_chain_model(), folder / "chain.onnx")
    onnx.save(fused_bert_model(), folder / "bert.onnx")
    onnx.save(unknown_op_model(), folder / "unknown.onnx")
    onnx.save(scalar_beta_model(), folder / "scalar_beta.onnx")
    onnx.save(scalar_beta_model(beta_as_input=True), folder / "beta_input.onnx")
    onnx.save(scalar_beta_model(canonical=True), folder / "canonical.onnx")
    onnx.save(skip_rms_model(), folder / "skip_rms.onnx")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "MOGRAPH_TRT_LIB_FIX")}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder)], capture_output=True, text=True, env=env, timeout=300
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return folder, json.loads(lines[-1][len("RESULT ") :])


def test_plugin_nodes_parse_without_anything_in_the_shell(plugin_builds):
    folder, out = plugin_builds
    chain = out["chain"]
    assert [(p["layer"], p.get("plugin"), p.get("namespace"), p.get("version")) for p in chain["plugin_layers"]] == [
        ("/ln/LayerNorm", "LayerNorm", "mograph", "1"),
        ("/act/Gelu", "Gelu", "mograph", "1"),
    ]
    assert chain["nonstandard_ops"] == ["mograph::LayerNorm", "mograph::Gelu"]
    assert chain["unsupported"] == []
    assert (folder / "chain.engine").stat().st_size == chain["engine_bytes"] > 0


def test_plugin_lib_fix_in_a_child_process(plugin_builds):
    folder, out = plugin_builds
    child = out["chain_child"]
    assert child["subprocess"] is True and "LD_LIBRARY_PATH=" in child["plugin_lib_fix"]
    assert [p.get("plugin") for p in child["plugin_layers"]] == ["LayerNorm", "Gelu"]
    assert (folder / "chain2.engine").stat().st_size == child["engine_bytes"]


def test_fused_bert_engine_builds_with_plugins(plugin_builds):
    folder, out = plugin_builds
    bert = out["bert"]
    plugins = [p.get("plugin") for p in bert["plugin_layers"]]
    assert plugins.count("LayerNorm") == 1
    assert plugins.count("SkipLayerNorm") == 4
    assert plugins.count("BiasGelu") == 2
    assert bert["mograph_plugin_layers"] == 7
    assert bert["profiles"] == {"input_ids": [[1, 1], [2, 16], [4, 128]]}
    assert (folder / "bert.engine").stat().st_size == bert["engine_bytes"] > 50_000


def test_skip_rmsnorm_engine_builds_with_its_plugin(plugin_builds):
    folder, out = plugin_builds
    model = onnx.load(str(folder / "skip_rms.onnx"))
    (node,) = [n for n in model.graph.node if n.domain == "mograph"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert node.op_type == "SkipRMSNorm" and attrs["sum_output"] == 1 and attrs["plugin_namespace"] == b"mograph"
    assert [o for o in node.output] == ["y", "s"]  # Sum kept: the graph reads it (s2 = s * 2)
    rms = out["skip_rms"]
    assert [p.get("plugin") for p in rms["plugin_layers"]] == ["SkipRMSNorm"]
    assert rms["mograph_plugin_layers"] == 1 and rms["unsupported"] == []
    assert (folder / "skip_rms.engine").stat().st_size == rms["engine_bytes"] > 0


def test_ops_tensorrt_cannot_take_are_listed(plugin_builds):
    _folder, out = plugin_builds
    unknown = out["unknown"]
    ops = {u["op"]: u for u in unknown["unsupported"]}
    assert {"MographNoSuchOp", "NotAnOnnxOp"} <= set(ops)
    assert ops["NotAnOnnxOp"]["node"] == "/odd/NotAnOnnxOp"
    assert "Plugin not found" in ops["MographNoSuchOp"]["error"]
    assert "MographNoSuchOp" in unknown["message"]


@needs_trt
def test_fusion_pass_output_builds_if_present(tmp_path):
    """When the fusion passes can target tensorrt, their output on bert_tiny must parse into mograph plugins."""
    from mograph.plugins import get_registry

    reg = get_registry()
    fusion = [n for n, p in reg.passes.items() if getattr(p, "family", "") == "fusion"]
    targets = [
        n for n in fusion if any(getattr(o, "name", "") == "target" for o in getattr(reg.passes[n], "options", ()))
    ]
    if not targets:
        pytest.skip("no fusion pass with a 'target' option is registered yet")
    from models.builders import bert_tiny
    from mograph import api, ir_io

    model, _report = api.optimize(bert_tiny(), ["cleanup", "fuse"], options={"target": "tensorrt"})
    path = tmp_path / "fused.onnx"
    ir_io.save_model(ir_io.load_model(model), path)
    prof = "1x4,2x16,4x64"
    code = (
        "import json, sys\nfrom mograph.backends.tensorrt import build_engine\n"
        f"r = build_engine(sys.argv[1], sys.argv[2], profiles={{'input_ids': '{prof}', 'attention_mask': '{prof}'}})\n"
        "print('RESULT ' + json.dumps(r))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path), str(tmp_path / "fused.engine")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    report = json.loads(lines[-1][7:])
    assert report["mograph_plugin_layers"] > 0, report["plugin_layers"]


def test_engine_file_is_not_half_written(trt, tmp_path, monkeypatch):
    """A failed build leaves no file behind (the engine is written atomically after the build)."""
    out = tmp_path / "fail.engine"
    model = native_layernorm_model()
    model.graph.node[0].op_type = "NoSuchOpAnywhere"
    model.graph.node[0].domain = "vendor"
    model.opset_import.append(helper.make_opsetid("vendor", 1))
    with pytest.raises(trt_backend.EngineBuildError) as info:
        trt_backend.build_engine(model, out, profiles={"x": "1x1x64,1x4x64,1x8x64"}, in_subprocess=True)
    assert info.value.report["unsupported"][0]["op"] == "NoSuchOpAnywhere"
    assert list(Path(tmp_path).iterdir()) == []


def test_illegal_plugin_nodes_are_refused_naming_the_node(plugin_builds):
    _folder, out = plugin_builds
    assert out["scalar_beta"]["problems"] == [
        "/sln/SkipLayerNorm (SkipLayerNorm plugin): has 2 outputs, the plugin gives 1 with these fields",
        "/sln/SkipLayerNorm (SkipLayerNorm plugin): input 3 (B) has shape [1], must be 1-D of X's last axis (64)",
    ]
    assert "2 problem(s) with mograph plugin nodes" in out["scalar_beta"]["message"]
    refused = out["beta_input"]  # B a graph input of shape [1]: refused the same way, before TensorRT sees it
    assert "input 3 (B) has shape [1], must be 1-D of X's last axis (64)" in refused["message"]


def test_canonical_ops_are_lowered_by_the_backend_first(plugin_builds):
    _folder, out = plugin_builds
    report = out["canonical"]
    assert report["lowered"] == {"lowered.SkipLayerNorm": 1}
    assert [p.get("plugin") for p in report["plugin_layers"]] == ["SkipLayerNorm"]
    assert report["unsupported"] == [] and report["engine_bytes"] > 0
