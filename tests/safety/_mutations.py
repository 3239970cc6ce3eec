"""Seeded structural mutations of small models built in code, for the fuzz test.

:func:`base_models` gives a few healthy models (an MLP inline and with external data, a small BERT with
the exporter patterns the fusions match, a small CNN, one with an ``If`` and a model-local function).
:func:`mutant` applies one to three mutations chosen by a seed: dropped nodes, rewired inputs (dangling
names, cycles), bad attributes, bad dtypes, huge/zero/negative dims, lying or missing external data,
unknown ops and opsets, broken outputs. The same seed always gives the same mutant.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from models.builders import bert_tiny, cnn_small, make_model

__all__ = ["Mutant", "base_models", "mutant", "MUTATIONS"]


@dataclass
class Mutant:
    """A model to write (``proto``), what was done to it, and how to write its external data, if any."""

    base: str
    proto: onnx.ModelProto
    applied: list[str] = field(default_factory=list)
    #: name -> bytes of files to write beside the model (its external data, possibly damaged)
    files: dict[str, bytes] = field(default_factory=dict)

    def write(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            (folder / name).write_bytes(data)
        path = folder / "m.onnx"
        path.write_bytes(self.proto.SerializeToString())
        return path


def _mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Identity", ["x"], ["xi"]),
        helper.make_node("MatMul", ["xi", "w"], ["t"]),
        helper.make_node("Add", ["t", "b"], ["u"]),
        helper.make_node("Relu", ["u"], ["y"]),
        helper.make_node("Sigmoid", ["x"], ["dead"]),
    ]
    inits = {"w": rng.standard_normal((8, 64)).astype(np.float32), "b": rng.standard_normal(64).astype(np.float32)}
    return make_model(nodes, [("x", np.float32, ["batch", 8])], [("y", np.float32, ["batch", 64])], inits)


def _control() -> onnx.ModelProto:
    """``y = If(cond, then: x + local.Scale(x), else: x * c)`` with a Constant in each branch."""
    shape = [2, 4]

    def branch(name: str, op: str) -> onnx.GraphProto:
        const = helper.make_node("Constant", [], [f"{name}_c"], value=numpy_helper.from_array(np.full(shape, 0.5, np.float32)))
        nodes = [const]
        if op == "Add":
            nodes.append(helper.make_node("Scale", ["x"], [f"{name}_s"], domain="local"))
            nodes.append(helper.make_node("Add", ["x", f"{name}_s"], [f"{name}_out"]))
        else:
            nodes.append(helper.make_node("Mul", ["x", f"{name}_c"], [f"{name}_out"]))
        out = helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, shape)
        return helper.make_graph(nodes, name, [], [out])

    function = helper.make_function(
        "local",
        "Scale",
        ["a"],
        ["b"],
        [
            helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array(3.0, np.float32))),
            helper.make_node("Mul", ["a", "k"], ["b"]),
        ],
        opset_imports=[helper.make_opsetid("", 17)],
    )
    node = helper.make_node("If", ["cond"], ["y"], then_branch=branch("then", "Add"), else_branch=branch("else", "Mul"))
    graph = helper.make_graph(
        [node],
        "control",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape), helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)], functions=[function]
    )
    model.ir_version = 8
    return model


def _externalize(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, bytes]]:
    """Move every initializer's bytes into one file ``m.onnx.data``; return the model and the file."""
    copy = onnx.ModelProto.FromString(proto.SerializeToString())
    blob = bytearray()
    for tensor in copy.graph.initializer:
        raw = numpy_helper.to_array(tensor).tobytes()
        offset = len(blob)
        blob += raw
        tensor.ClearField("raw_data")
        for name in ("float_data", "int64_data", "int32_data", "double_data"):
            tensor.ClearField(name)
        tensor.data_location = TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value="m.onnx.data")
        tensor.external_data.add(key="offset", value=str(offset))
        tensor.external_data.add(key="length", value=str(len(raw)))
    return copy, {"m.onnx.data": bytes(blob)}


def base_models() -> dict[str, tuple[onnx.ModelProto, dict[str, bytes]]]:
    """Healthy models by name, each with the files that go beside it."""
    mlp = _mlp()
    return {
        "mlp": (mlp, {}),
        "mlp-external": _externalize(mlp),
        "bert": (bert_tiny(layers=1, hidden=16, heads=2, ffn=32, vocab=20, max_position=32), {}),
        "cnn": (cnn_small(), {}),
        "control": (_control(), {}),
    }


# --------------------------------------------------------------------------------------------------
# Mutations: each takes (rng, mutant) and changes mutant.proto / mutant.files in place, returning a
# short description (or None when it found nothing to change).


def _graphs(proto: onnx.ModelProto) -> list[onnx.GraphProto]:
    out, todo = [], [proto.graph]
    while todo:
        g = todo.pop()
        out.append(g)
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("g"):
                    todo.append(attr.g)
                todo.extend(attr.graphs)
    return out


def _pick_node(rng: random.Random, m: Mutant) -> tuple[onnx.GraphProto, int] | None:
    choices = [(g, i) for g in _graphs(m.proto) for i in range(len(g.node))]
    return rng.choice(choices) if choices else None


def _names(m: Mutant) -> list[str]:
    g = m.proto.graph
    names = [v.name for v in g.input] + [t.name for t in g.initializer]
    names += [o for n in g.node for o in n.output]
    return [n for n in names if n]


def drop_node(rng: random.Random, m: Mutant) -> str | None:
    picked = _pick_node(rng, m)
    if picked is None:
        return None
    g, i = picked
    op = g.node[i].op_type
    del g.node[i]
    return f"drop node {i} ({op})"


def rewire_input(rng: random.Random, m: Mutant) -> str | None:
    picked = _pick_node(rng, m)
    if picked is None or not picked[0].node[picked[1]].input:
        return None
    g, i = picked
    node = g.node[i]
    slot = rng.randrange(len(node.input))
    kind = rng.choice(["existing", "dangling", "empty", "own-output", "later-output"])
    if kind == "existing":
        target = rng.choice(_names(m))
    elif kind == "dangling":
        target = f"nowhere_{rng.randrange(1000)}"
    elif kind == "empty":
        target = ""
    elif kind == "own-output" and node.output:
        target = node.output[0]
    else:
        later = [o for n in g.node[i + 1 :] for o in n.output]
        target = rng.choice(later) if later else "nowhere"
    node.input[slot] = target
    return f"rewire {node.op_type}.input[{slot}] -> {kind} {target!r}"


_WEIRD_INTS = [-(2**62), -7, -1, 0, 1, 3, 99, 2**31, 2**40]


def bad_attribute(rng: random.Random, m: Mutant) -> str | None:
    nodes = [n for g in _graphs(m.proto) for n in g.node if n.attribute]
    if not nodes:
        return None
    node = rng.choice(nodes)
    attr = rng.choice(list(node.attribute))
    kind = rng.choice(["int", "ints", "float", "type", "delete", "unknown", "tensor-dtype"])
    if kind == "delete":
        node.attribute.remove(attr)
        return f"delete {node.op_type}.{attr.name}"
    if kind == "unknown":
        node.attribute.append(helper.make_attribute(f"bogus_{rng.randrange(100)}", rng.choice(_WEIRD_INTS)))
        return f"add unknown attribute to {node.op_type}"
    if kind == "int" or (kind == "type" and attr.type == onnx.AttributeProto.INT):
        value = rng.choice(_WEIRD_INTS)
        new = helper.make_attribute(attr.name, value) if kind == "int" else helper.make_attribute(attr.name, [value, value])
    elif kind == "ints":
        new = helper.make_attribute(attr.name, [rng.choice(_WEIRD_INTS) for _ in range(rng.randrange(0, 6))] or [5])
    elif kind == "float":
        new = helper.make_attribute(attr.name, rng.choice([float("nan"), float("inf"), -1e30, 0.0]))
    elif kind == "tensor-dtype" and attr.type == onnx.AttributeProto.TENSOR:
        attr.t.data_type = rng.choice([0, 2, 7, 8, 11, 16, 999])
        return f"{node.op_type}.{attr.name} tensor dtype -> {attr.t.data_type}"
    else:
        new = helper.make_attribute(attr.name, "a string")
    index = list(node.attribute).index(attr)
    node.attribute.remove(attr)
    node.attribute.insert(index, new)
    return f"{node.op_type}.{attr.name} -> {kind} {helper.get_attribute_value(new)!r}"


def bad_dtype(rng: random.Random, m: Mutant) -> str | None:
    g = m.proto.graph
    kind = rng.choice(["initializer", "input", "output", "cast"])
    dtype = rng.choice([0, 2, 3, 6, 7, 9, 10, 11, 16, 17, 23, 999])
    if kind == "initializer" and g.initializer:
        t = rng.choice(list(g.initializer))
        t.data_type = dtype
        return f"initializer {t.name} dtype -> {dtype}"
    if kind == "input" and g.input:
        v = rng.choice(list(g.input))
        v.type.tensor_type.elem_type = dtype
        return f"input {v.name} dtype -> {dtype}"
    if kind == "output" and g.output:
        v = rng.choice(list(g.output))
        v.type.tensor_type.elem_type = dtype
        return f"output {v.name} dtype -> {dtype}"
    casts = [n for n in g.node if n.op_type == "Cast"]
    if casts:
        node = rng.choice(casts)
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("to", dtype))
        return f"Cast to -> {dtype}"
    return None


_WEIRD_DIMS = [0, -3, -1, 2**40, 2**31 + 7, 100000]


def weird_dims(rng: random.Random, m: Mutant) -> str | None:
    g = m.proto.graph
    kind = rng.choice(["input", "initializer", "reshape", "value_info"])
    dim = rng.choice(_WEIRD_DIMS)
    if kind == "input" and g.input:
        v = rng.choice(list(g.input))
        dims = v.type.tensor_type.shape.dim
        if dims:
            d = rng.choice(list(dims))
            d.ClearField("dim_param")
            d.dim_value = dim
            return f"input {v.name} dim -> {dim}"
    if kind == "initializer" and g.initializer:
        t = rng.choice(list(g.initializer))
        if t.dims:
            t.dims[rng.randrange(len(t.dims))] = dim
        else:
            t.dims.append(dim)
        return f"initializer {t.name} dims -> {list(t.dims)}"
    if kind == "reshape":
        shapes = {n.input[1] for n in g.node if n.op_type in ("Reshape", "Expand", "Tile", "ConstantOfShape") and len(n.input) > 1}
        shapes |= {n.input[0] for n in g.node if n.op_type == "ConstantOfShape" and n.input}
        inits = [t for t in g.initializer if t.name in shapes and t.data_type == TensorProto.INT64]
        if inits:
            t = rng.choice(inits)
            values = numpy_helper.to_array(t).copy().reshape(-1)
            if values.size:
                values[rng.randrange(values.size)] = abs(dim) if dim else 0
                t.CopyFrom(numpy_helper.from_array(values.reshape(numpy_helper.to_array(t).shape), t.name))
                return f"shape tensor {t.name} -> {values.tolist()}"
    outs = list(g.output) + list(g.value_info)
    if outs:
        v = rng.choice(outs)
        shape = v.type.tensor_type.shape
        shape.ClearField("dim")
        for _ in range(rng.randrange(0, 4)):
            shape.dim.add().dim_value = abs(rng.choice(_WEIRD_DIMS)) or 1
        return f"declared shape of {v.name} -> {[d.dim_value for d in shape.dim]}"
    return None


def external_data(rng: random.Random, m: Mutant) -> str | None:
    tensors = [t for g in _graphs(m.proto) for t in g.initializer if t.data_location == TensorProto.EXTERNAL]
    kind = rng.choice(["missing-file", "truncate", "location", "offset", "length", "dims", "externalize-constant"])
    if kind == "externalize-constant":
        consts = [n for g in _graphs(m.proto) for n in g.node if n.op_type == "Constant" and n.attribute and n.attribute[0].HasField("t")]
        if not consts:
            return None
        t = rng.choice(consts).attribute[0].t
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        t.external_data.add(key="location", value=rng.choice(["c.bin", "../c.bin", "/etc/hostname", "m.onnx"]))
        return f"Constant value -> external {t.external_data[0].value}"
    if not tensors:
        return None
    if kind == "missing-file":
        m.files.clear()
        return "delete the data file"
    if kind == "truncate":
        for name in m.files:
            m.files[name] = m.files[name][: rng.randrange(len(m.files[name]) + 1)]
        return "truncate the data file"
    t = rng.choice(tensors)
    entries = {e.key: e for e in t.external_data}
    if kind == "location":
        entries["location"].value = rng.choice(["../m.onnx.data", "/etc/passwd", "nope.bin", ".", "", "sub/../../x", "m.onnx"])
        return f"{t.name} location -> {entries['location'].value!r}"
    if kind == "offset":
        value = str(rng.choice([-8, 3, 10**9, 2**40]))
        if "offset" in entries:
            entries["offset"].value = value
        else:
            t.external_data.add(key="offset", value=value)
        return f"{t.name} offset -> {value}"
    if kind == "length":
        value = str(rng.choice([0, 1, 10**12]))
        if "length" in entries:
            entries["length"].value = value
        else:
            t.external_data.add(key="length", value=value)
        return f"{t.name} length -> {value}"
    t.dims[rng.randrange(len(t.dims))] = rng.choice([2**40, 100000, 0])
    return f"{t.name} dims -> {list(t.dims)} (external)"


_OPS = ["Relu", "Softmax", "Add", "MatMul", "Reshape", "Transpose", "Concat", "Gather", "NoSuchOp", "Loop"]


def change_op(rng: random.Random, m: Mutant) -> str | None:
    picked = _pick_node(rng, m)
    if picked is None:
        return None
    g, i = picked
    node = g.node[i]
    if rng.random() < 0.25:
        node.domain = rng.choice(["com.unknown", "mograph", "ai.onnx.ml"])
        return f"{node.op_type} domain -> {node.domain}"
    old, node.op_type = node.op_type, rng.choice(_OPS)
    return f"op {old} -> {node.op_type}"


def change_opset(rng: random.Random, m: Mutant) -> str | None:
    kind = rng.choice(["version", "remove", "duplicate"])
    default = next((o for o in m.proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if kind == "remove" and default is not None:
        m.proto.opset_import.remove(default)
        return "remove the default opset"
    if kind == "duplicate":
        m.proto.opset_import.add(domain="", version=rng.choice([7, 13, 21]))
        return "duplicate the default opset"
    if default is not None:
        default.version = rng.choice([1, 6, 10, 99, 10**6])
        return f"default opset -> {default.version}"
    return None


def break_outputs(rng: random.Random, m: Mutant) -> str | None:
    g = m.proto.graph
    kind = rng.choice(["remove", "rename", "duplicate", "input-as-output", "double-producer"])
    if kind == "remove" and g.output:
        del g.output[rng.randrange(len(g.output))]
        return "remove a graph output"
    if kind == "rename" and g.output:
        g.output[0].name = "never_produced"
        return "rename the graph output to a value nobody produces"
    if kind == "duplicate" and g.output:
        g.output.append(onnx.ValueInfoProto.FromString(g.output[0].SerializeToString()))
        return "duplicate a graph output"
    if kind == "input-as-output" and g.input:
        g.output.append(onnx.ValueInfoProto.FromString(g.input[0].SerializeToString()))
        return "graph input listed as output"
    if len(g.node) >= 2:
        a, b = rng.sample(range(len(g.node)), 2)
        if g.node[a].output and g.node[b].output:
            g.node[b].output[0] = g.node[a].output[0]
            return f"node {b} writes node {a}'s output too"
    return None


MUTATIONS: list[Callable[[random.Random, Mutant], str | None]] = [
    drop_node,
    rewire_input,
    bad_attribute,
    bad_dtype,
    weird_dims,
    external_data,
    change_op,
    change_opset,
    break_outputs,
]


def mutant(seed: int, bases: dict[str, tuple[onnx.ModelProto, dict[str, bytes]]]) -> Mutant:
    """The mutant number ``seed``: a base model (in turn) with one to three seeded mutations."""
    rng = random.Random(seed)
    names = sorted(bases)
    base = names[seed % len(names)]
    proto, files = bases[base]
    m = Mutant(base, onnx.ModelProto.FromString(proto.SerializeToString()), files=dict(files))
    wanted = rng.randint(1, 3)
    for _ in range(20):  # a mutation that finds nothing to change is drawn again
        if len(m.applied) == wanted:
            break
        done = rng.choice(MUTATIONS)(rng, m)
        if done:
            m.applied.append(done)
    return m
