"""Packing Q/K/V projections already lowered to ``MatMulNBits`` into one: exact where bits, block size and the
input agree, counted and left alone where they do not (the GQA lowering's use: test_weight_only_packed_qkv)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph.passes.fusion.lowerings.packed_nbits import PACKED_FROM_KEY, pack_nbits_projections
from mograph.passes.quant import WeightOnlyPass
from onnx import helper, numpy_helper

from mograph.lowering import LoweringContext, lower_model
from mograph.plugins import get_registry
from mograph.testing import run_ort, to_ir, to_proto, with_registry

pytest.importorskip("onnxruntime")

K = 96  # three blocks of 32: the 4-bit zero points are packed two blocks a byte, the last byte half padding
WIDTHS = {"q": 48, "k": 16, "v": 16}


def projections(seed: int = 0) -> onnx.ModelProto:
    """``x`` and its three projections ``q``, ``k``, ``v`` (graph outputs)."""
    rng = np.random.default_rng(seed)
    nodes, inits, outs = [], [], []
    for name, n in WIDTHS.items():
        inits.append(numpy_helper.from_array((rng.standard_normal((K, n)) * 0.1).astype(np.float32), f"W{name}"))
        nodes.append(helper.make_node("MatMul", ["x", f"W{name}"], [name], name=f"{name}_proj"))
        outs.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["B", "S", n]))
    graph = helper.make_graph(nodes, "qkv", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", "S", K])],
                              outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def lowered(plan: dict[str, str] | None = None, **options: Any) -> ir.Model:
    """The projections weight-only quantized (RTN, blocks of 32 unless told) and lowered to MatMulNBits."""
    model = to_ir(projections())
    opts = {"algorithm": "rtn", "block_size": 32, "output_projection": "bits", **options}
    if plan is not None:
        opts["precision_plan"] = {"nodes": [{"node": f"{k}_proj", "precision": p} for k, p in plan.items()]}
    assert with_registry(WeightOnlyPass(**opts)).call(model).modified
    assert lower_model(model, "ort", registry=get_registry()).modified
    return model


def pack(model: ir.Model) -> tuple[ir.Value | None, dict[str, int], list[ir.Node]]:
    """Pack the three outputs; the packed value becomes the graph output ``qkv``."""
    graph = model.graph
    ctx = LoweringContext(model, "ort")
    new_nodes: list[ir.Node] = []
    out = pack_nbits_projections(list(graph.outputs[:3]), graph, new_nodes, ctx)
    for node in new_nodes:
        graph.append(node)
    if out is not None:
        out.name = "qkv"
        graph.outputs.append(out)
    return out, ctx.stats, new_nodes


def feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((2, 5, K)).astype(np.float32)}


def nbits(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == "MatMulNBits"]


@pytest.mark.parametrize(("bits", "symmetric"), [(4, False), (4, True), (8, False), (8, True)])
def test_packed_node_computes_the_three_exactly(bits: int, symmetric: bool) -> None:
    model = lowered(bits=bits, symmetric=symmetric)
    out, stats, new = pack(model)
    assert out is not None and stats == {"attention.packed_qkv.nbits": 1}
    (node,) = new
    attrs = {k: a.as_int() for k, a in node.attributes.items()}
    assert attrs == {"K": K, "N": sum(WIDTHS.values()), "bits": bits, "block_size": 32}
    assert (len(node.inputs) == 4) == (not symmetric)  # zero points only where the three had them
    assert node.metadata_props[PACKED_FROM_KEY] == "q_proj,k_proj,v_proj"
    q, k, v, qkv = run_ort(to_proto(model), feeds())
    ref = np.concatenate([q, k, v], axis=-1)
    assert qkv.shape == ref.shape == (2, 5, 80)
    assert float(np.abs(qkv - ref).max()) <= 1e-6  # the same codes, scales and zero points per column


def test_symmetric_next_to_asymmetric_gets_its_default_zero_points() -> None:
    """k quantized symmetric (no zero-point input) among asymmetric q and v: its zero points are written out."""
    model = lowered(bits=4)
    sym = lowered(bits=4, symmetric=True)
    k_asym = next(n for n in nbits(model) if n.name == "k_proj")
    k_sym = next(n for n in nbits(sym) if n.name == "k_proj")
    for i in (1, 2):  # take the symmetric node's codes and scales, drop the zero points
        arr = k_sym.inputs[i].const_value.numpy()  # type: ignore[union-attr]
        value = ir.Value(name=f"k_sym_{i}", const_value=ir.tensor(arr, name=f"k_sym_{i}"),
                         type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)), shape=ir.Shape(arr.shape))
        model.graph.register_initializer(value)
        k_asym.replace_input_with(i, value)
    k_asym.resize_inputs(3)
    out, stats, new = pack(model)
    assert out is not None and stats == {"attention.packed_qkv.nbits": 1}
    zp = new[0].inputs[3].const_value.numpy()  # type: ignore[union-attr]
    assert zp.shape == (80, 2) and (zp[48:64] == 0x88).all()  # k's rows: 8 in both nibbles
    q, k, v, qkv = run_ort(to_proto(model), feeds())
    assert float(np.abs(qkv - np.concatenate([q, k, v], axis=-1)).max()) <= 1e-6


@pytest.mark.parametrize(("plan", "why"), [({"k": "int8"}, "mixed_precision"), ({"v": "float"}, "mixed_precision")])
def test_different_precisions_from_the_plan_are_not_packed(plan: dict[str, str], why: str) -> None:
    model = lowered(plan=plan)
    before = Counter(n.op_type for n in model.graph)
    out, stats, new = pack(model)
    assert out is None and new == [] and stats == {f"attention.unpacked_qkv.{why}": 1}
    assert Counter(n.op_type for n in model.graph) == before


def test_different_block_sizes_are_not_packed() -> None:
    model = lowered()
    other = lowered(block_size=16)
    v32 = next(n for n in nbits(model) if n.name == "v_proj")
    v16 = next(n for n in nbits(other) if n.name == "v_proj")
    v32.attributes["block_size"] = v16.attributes["block_size"]  # as if the plan had given v another block size
    out, stats, new = pack(model)
    assert out is None and new == [] and stats == {"attention.unpacked_qkv.block_size": 1}


def test_float_projections_are_not_its_business() -> None:
    model = to_ir(projections())
    out, stats, new = pack(model)
    assert out is None and new == [] and stats == {}
