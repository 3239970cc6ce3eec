"""Small IR helpers shared by passes, lowerings and backends: attributes, initializers, constants.

Each is a one-liner's worth of logic that used to be written out in several modules; keeping them
here keeps their edge cases (a missing attribute, a taken initializer name, a dynamic last axis)
handled the same way everywhere.
"""

from __future__ import annotations

import logging
import operator
from collections import UserDict
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from mograph._traverse import subgraphs

__all__ = ["attr_constant", "constant_array", "scalar_value", "attr_value", "add_initializer", "unique_initializer_name", "is_zero", "static_last_dim", "value_used",
           "infer_types", "restore_types", "run_shape_inference", "TypeSnapshot", "fresh_name", "unshadow_value_names",
           "constants_as_tensors", "inference_token", "remember_inference"]

logger = logging.getLogger(__name__)

#: What :func:`infer_types` found on each value before it ran, for :func:`restore_types`.
TypeSnapshot = list[tuple[ir.Value, Any, Any]]


# ---------------------------------------------------------------------------------------------
# constants (read by the pattern rules, the lowerings and the passes alike)
# ---------------------------------------------------------------------------------------------

#: Ops the constant evaluator looks through (all inputs constant -> result constant).
_MAX_CONST_DEPTH = 8


# ---------------------------------------------------------------------------------------------
# constants
# ---------------------------------------------------------------------------------------------


def attr_constant(node: ir.Node) -> np.ndarray | None:
    """The value of a ``Constant`` node from its attributes; None for a reference or an unknown form."""
    for key, attr in node.attributes.items():
        if attr.is_ref():
            return None
        if key == "value" and attr.type == ir.AttributeType.TENSOR:  # (a Protocol isinstance check is slow)
            return attr.value.numpy()
        if key == "value_float":
            return np.array(attr.value, dtype=np.float32)
        if key == "value_int":
            return np.array(attr.value, dtype=np.int64)
        if key == "value_floats":
            return np.array(list(attr.value), dtype=np.float32)
        if key == "value_ints":
            return np.array(list(attr.value), dtype=np.int64)
    return None


#: ``Constant``'s numeric scalar and list attributes, added in opset 12 (before it only ``value``, a tensor,
#: and ``sparse_value``): attribute -> numpy dtype of the tensor that says the same.  (The string forms are
#: opset 12 too; no folder writes them.)
_CONSTANT_LIST_ATTRS = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64,
                        "value_ints": np.int64}
CONSTANT_LIST_OPSET = 12


def constants_as_tensors(model: ir.Model) -> int:
    """Below opset 12, rewrite every ``Constant`` that uses ``value_int(s)`` or ``value_float(s)`` (opset 12
    attributes, which onnxscript's constant folder writes whatever the opset)
    into the ``value`` tensor form, in every graph; return how many.  The ONNX checker refuses those
    attributes at opset 11 ("Unrecognized attribute: value_ints for operator Constant")."""
    opset = int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", CONSTANT_LIST_OPSET)))
    if opset >= CONSTANT_LIST_OPSET:
        return 0
    done = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            continue
        hits = [k for k in node.attributes if k in _CONSTANT_LIST_ATTRS and not node.attributes[k].is_ref()]
        if len(hits) != 1:
            continue
        attr = node.attributes[hits[0]]
        raw = attr.value if hits[0] in ("value_float", "value_int") else list(attr.value)
        arr = np.array(raw, dtype=_CONSTANT_LIST_ATTRS[hits[0]])
        del node.attributes[hits[0]]
        node.attributes["value"] = ir.AttrTensor("value", ir.tensor(arr))
        done += 1
    return done


_UNARY: dict[str, Callable[[np.ndarray], Any]] = {
    "Identity": lambda a: a,
    "Sqrt": np.sqrt,
    "Reciprocal": lambda a: np.reciprocal(a),
    "Neg": np.negative,
}
_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], Any]] = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": lambda a, b: a / b if a.dtype.kind == "f" else a // b,
    "Pow": np.power,
}
#: The ops :func:`constant_array` looks through (besides ``Constant``): any other producer is no constant.
_THROUGH = frozenset({"Cast", "CastLike", "Reshape", "Unsqueeze", "Squeeze", *_UNARY, *_BINARY})


def constant_array(value: ir.Value | None, _depth: int = 0) -> np.ndarray | None:
    """The value as a numpy array if it is a constant in any form, else ``None``.

    Looks through initializers (not those that are also graph inputs: a user may override them),
    ``Constant`` nodes, and ``Cast``/``CastLike``/``Identity``/``Reshape``/``Unsqueeze``/``Squeeze``/``Sqrt``/
    ``Reciprocal``/``Neg`` and binary arithmetic over constants, to a small depth.  Nothing in the
    graph is changed.
    """
    if value is None or _depth > _MAX_CONST_DEPTH:
        return None
    if value.is_graph_input():
        return None
    if value.const_value is not None:
        try:
            return value.const_value.numpy()
        except Exception:  # noqa: BLE001 - external data missing: not usable as a constant
            return None
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    op = node.op_type
    if op == "Constant":
        return attr_constant(node)
    if op not in _THROUGH:  # without evaluating its inputs first: deep chains of activations cost nothing
        return None
    # The first input decides (most ops read activations, not constants): evaluate it alone first.
    if not node.inputs or node.inputs[0] is None:
        return None
    a = constant_array(node.inputs[0], _depth + 1)
    if a is None:
        return None
    args: list[np.ndarray | None] = [a]
    if op in _BINARY and len(node.inputs) == 2:
        args.append(constant_array(node.inputs[1], _depth + 1) if node.inputs[1] is not None else None)
    try:
        if op == "Cast":
            to = node.attributes.get("to")
            return a.astype(ir.DataType(to.value).numpy()) if to is not None else None
        if op == "CastLike":  # to the dtype of its second input (a value of any kind, read for its dtype only)
            like = node.inputs[1] if len(node.inputs) > 1 else None
            return a.astype(like.dtype.numpy()) if like is not None and like.dtype is not None else None
        if op in _UNARY:
            return np.asarray(_UNARY[op](a))
        if op in _BINARY and len(args) == 2 and args[1] is not None:
            return np.asarray(_BINARY[op](a, args[1])).astype(np.result_type(a, args[1]))
        if op in ("Reshape", "Unsqueeze", "Squeeze"):
            # Only single-element tensors matter to the rules: keep the element, drop the rank.
            return a.reshape(()) if a.size == 1 else None
    except (ValueError, TypeError, OverflowError):
        return None
    return None


def scalar_value(value: ir.Value | None) -> float | None:
    """The single element of a constant value (see :func:`constant_array`) as a float, else ``None``."""
    arr = constant_array(value)
    if arr is None or arr.size != 1:
        return None
    return float(arr.reshape(()))


def attr_value(node: ir.Node, name: str, default: Any = None) -> Any:
    """The value of attribute ``name`` of ``node``, or ``default`` when it has none."""
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def fresh_name(taken: set[str], base: str, cursors: dict[str, int] | None = None) -> str:
    """``base``, or ``base_1``, ``base_2`` ...: the first name not in ``taken``, which then holds it.

    ``cursors`` (one dict per ``taken`` set, for a caller that names many nodes from one base) remembers
    where the last search for each base ended, so the next starts there instead of at ``base``: the same
    name while ``taken`` only grows, without probing every name given so far (quadratic in their number:
    2 CPU-seconds for the 4,760 shape nodes of a 100k-node graph).
    """
    i = 0 if cursors is None else cursors.get(base, 0)
    name = base if i == 0 else f"{base}_{i}"
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    if cursors is not None:
        cursors[base] = i
    return name


def unshadow_value_names(model: ir.Model) -> int:
    """Rename each subgraph value whose name is taken in its own graph or an enclosing one; return how many.

    ONNX wants a value's name unique in its graph and in every graph around it (a branch's value may not
    shadow an outer one: the ONNX checker refuses the model, and a node of the branch that reads the
    outer value would read the inner one once serialized).  onnx_ir names a new value from its own
    graph's counter (``val_0``, ``val_1`` ...), and a subgraph's counter knows nothing of the graphs
    around it: a pass that adds nodes both to an ``If`` branch and to the main graph (a lowering that
    inlines a function body in each) writes ``val_0`` twice.  The main graph keeps its names (its inputs
    and outputs are the model's interface), and so does every value whose name is free; a clashing one
    becomes ``name_1``, ``name_2`` ...  Sibling branches may share names (neither encloses the other).
    Walks the model once, only when it has subgraphs.
    """
    scope: set[str] = set()
    renamed = 0

    def own_values(graph: ir.Graph) -> list[ir.Value]:
        return [*graph.inputs, *graph.initializers.values(), *(o for n in graph for o in n.outputs)]

    def visit(graph: ir.Graph, main: bool) -> None:
        nonlocal renamed
        added: list[str] = []
        for value in own_values(graph):
            name = value.name
            if not name:
                continue
            if name in scope and not main:
                value.name = fresh_name(scope, name)
                renamed += 1
            else:
                scope.add(name)
            added.append(value.name or name)
        for node in graph:
            for attr in node.attributes.values():
                if attr.is_ref():
                    continue
                if attr.type == ir.AttributeType.GRAPH:
                    visit(attr.value, False)
                elif attr.type == ir.AttributeType.GRAPHS:
                    for sub in attr.value:
                        visit(sub, False)
        if not main:
            scope.difference_update(added)

    if subgraphs(model.graph):
        visit(model.graph, True)
    return renamed


def unique_initializer_name(graph: ir.Graph, base: str) -> str:
    """``base``, or ``base_1``, ``base_2`` ... : the first name no initializer of ``graph`` has."""
    name, i = base, 0
    while name in graph.initializers:
        i += 1
        name = f"{base}_{i}"
    return name


def add_initializer(graph: ir.Graph, base: str, arr: np.ndarray) -> ir.Value:
    """Register ``arr`` as a new initializer of ``graph`` under a fresh name derived from ``base``."""
    name = unique_initializer_name(graph, base)
    value = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                     const_value=ir.tensor(arr, name=name))
    graph.register_initializer(value)
    return value


def is_zero(value: ir.Value | None) -> bool:
    """True for a missing input or a constant of zeros."""
    if value is None:
        return True
    arr = constant_array(value)
    return arr is not None and not np.any(arr)


def static_last_dim(value: ir.Value | None) -> int | None:
    """The size of ``value``'s last axis when it is known statically, else None."""
    if value is None or value.shape is None or len(value.shape) == 0:
        return None
    dim = value.shape[-1]
    return dim if isinstance(dim, int) else None


def value_used(value: ir.Value) -> bool:
    """Whether anything reads ``value`` (a node or the graph's outputs)."""
    return bool(value.uses()) or value.is_graph_output()



class _ErrorsOnlyFilter(logging.Filter):
    """Drops the records below ERROR of the logger it is on: onnx_ir's shape-inference warnings during
    :func:`infer_types`, which is best effort.  A filter, not ``setLevel``: every ``setLevel`` clears the
    level cache of every logger of the process (thousands with torch and transformers loaded), a
    millisecond per call, twice per inference."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


_ERRORS_ONLY = _ErrorsOnlyFilter()

def infer_types(model: ir.Model) -> TypeSnapshot:
    """Annotate values with inferred types and shapes (best effort); return what they had before.

    Exporters (TorchScript in particular) leave intermediate values without types; rules and
    lowerings need dtypes and ranks.  A pass that then changes nothing calls :func:`restore_types`,
    so it stays a no-op.

    The result of the last inference is kept on the model (``model.meta``) with the graph's structure
    (the node, input, attribute and initializer objects) and the types it started from: when neither
    changed since, inference would find the same again, and its types are put back without running
    it.  This is what keeps a pipeline of fusion passes that each change nothing (or change little)
    from paying a whole-model inference per pass.  When the graph changed since (a pass fused something), the
    nodes that changed are inferred alone where that shows what the whole-model inference would find
    (:func:`_confirmed_by_region`); the whole model is inferred otherwise.
    """
    graphs = _graphs(model)
    structure, snapshot, marks = _walk(graphs)
    cached = model.meta.get(_INFERRED_KEY)
    if cached is not None and _same_objects(cached[0], structure) and _same_types(cached[1], snapshot):
        for (value, _, _), (type_, shape) in zip(snapshot, cached[2]):
            value.type, value.shape = type_, shape
        return snapshot
    if cached is not None and len(graphs) == 1 and _confirmed_by_region(model, cached, structure, snapshot, marks):
        model.meta[_INFERRED_KEY] = (structure, [(t, sh) for _, t, sh in snapshot],
                                     [(v.type, v.shape) for v, _, _ in snapshot], [v for v, _, _ in snapshot], _context(model),
                                     marks)
        return snapshot
    quiet = logging.getLogger("onnx_ir.passes.common.shape_inference")
    added = _ERRORS_ONLY not in quiet.filters  # not when an inference is already running (nested, a thread)
    if added:
        quiet.addFilter(_ERRORS_ONLY)
    orders = [(g, list(g.initializers.values())) for g in graphs]
    completed = False
    try:
        run_shape_inference(model)
        completed = True
    except Exception:  # noqa: BLE001 - inference is best effort; rules fail with a reason without it
        logger.debug("shape inference failed", exc_info=True)
    finally:
        if added:
            quiet.removeFilter(_ERRORS_ONLY)
        for g, inits in orders:  # the inference call re-registers initializers: keep their order
            if list(g.initializers.values()) != inits:
                for v in inits:
                    if v.name is not None and g.initializers.get(v.name) is v:
                        g.initializers.pop(v.name)
                for v in inits:
                    g.initializers.add(v)
    # What a later call needs to confirm this result by inferring only what changed (:func:`_confirmed_by_region`):
    # a flat model's inference that completed, on a graph in order.
    confirmable = completed and len(graphs) == 1 and _in_order(model.graph) is not None
    model.meta[_INFERRED_KEY] = (structure, [(t, sh) for _, t, sh in snapshot],
                                 [(v.type, v.shape) for v, _, _ in snapshot], [v for v, _, _ in snapshot],
                                 _context(model) if confirmable else None, marks)
    return snapshot


def _context(model: ir.Model) -> tuple[Any, ...]:
    """What an inference depends on besides the graph: the IR version, the opsets, the local functions."""
    return model.ir_version, dict(model.opset_imports), dict(model.functions)


def remember_inference(model: ir.Model) -> None:
    """Record the types of ``model`` as the result of a whole-model inference that just completed (as
    :func:`run_shape_inference` with data propagation leaves them, nothing changed since), so that the next
    :func:`infer_types` may reuse or confirm it (:func:`_confirmed_by_region`) instead of inferring the whole
    model again.  Recorded only for a flat model whose graph is in order (a fixed point of inference then);
    otherwise any earlier record is dropped."""
    graphs = _graphs(model)
    if len(graphs) != 1 or _in_order(model.graph) is None:
        model.meta.pop(_INFERRED_KEY, None)
        return
    structure, snapshot, marks = _walk(graphs)
    types = [(t, sh) for _, t, sh in snapshot]
    model.meta[_INFERRED_KEY] = (structure, types, types, [v for v, _, _ in snapshot], _context(model), marks)


_INFERRED_KEY = "mograph.inferred_types"


def inference_token(model: ir.Model) -> object | None:
    """An object that stands for the last inference :func:`infer_types` ran on ``model`` (``None`` before any).

    It is the same object after a later :func:`infer_types` call exactly when that call found the graph as the
    inference had it (the same node, value, attribute and initializer objects, the same types before it) and put
    the inferred types back without running it: a caller that keeps something it computed from the graph right
    after an inference can tell, by this token, that the graph is again as it was then."""
    return model.meta.get(_INFERRED_KEY)

#: Initializers above this many bytes are passed to ONNX inference as typed inputs, without their data.
_BIG_TENSOR_BYTES = 1000


def _graphs(model: ir.Model) -> list[ir.Graph]:
    return [model.graph, *subgraphs(model.graph)]


def run_shape_inference(model: ir.Model, *, data_prop: bool = True) -> None:
    """ONNX shape inference (``check_type`` and ``strict_mode`` off), its dtypes and shapes merged into
    the model's values in place.  Raises what ONNX raises; the model is then unchanged.

    Where an older version of an op infers less than its later versions (:data:`_CONSTANT_TARGET_BELOW`: a
    ``Reshape`` below opset 14 has no output shape unless its target is a constant), the main graph's outputs
    of those nodes get the dims the shape rules prove (:func:`_complete_shapes`), and ONNX infers again from
    them, so that what follows is inferred as at the later opset (should ONNX fail on a later round, the
    model keeps what the rounds before found)."""
    _run_onnx_inference(model, data_prop)
    for _ in range(len(model.graph)):  # each round gives at least one more such node its shape
        if not _complete_shapes(model):
            break
        try:
            _run_onnx_inference(model, data_prop)
        except Exception:  # noqa: BLE001 - the first round's result stands, with the shapes completed since
            logger.debug("shape inference after completing shapes failed", exc_info=True)
            break


def _run_onnx_inference(model: ir.Model, data_prop: bool) -> None:
    if subgraphs(model.graph):  # onnx_ir's pass matches the subgraphs' values to the inferred ones
        from onnx_ir.passes.common import ShapeInferencePass

        ShapeInferencePass(check_type=False, strict_mode=False, data_prop=data_prop)(model)
    else:
        _infer_flat(model, data_prop)


#: Standard ops whose ONNX inference below an opset version gives their output no shape, not even a rank,
#: unless the target shape (input 1) is a constant, where the later versions read its length and the elements
#: ONNX's data propagation computed (``Shape``/``Gather``/``Concat`` of the runtime shape, as exporters write a
#: reshape to ``[batch, seq, heads, head_dim]``): op type -> the first version that does.  Checked with onnx
#: 1.23: ``Reshape`` 5 and 13 infer only from a constant target, 14 reads it as data.
_CONSTANT_TARGET_BELOW: dict[str, int] = {"Reshape": 14}


def _old_default_opset(opsets: Any) -> bool:
    """Whether the default domain's opset is below a version of :data:`_CONSTANT_TARGET_BELOW`."""
    version = opsets.get("", opsets.get("ai.onnx"))
    return version is not None and version < max(_CONSTANT_TARGET_BELOW.values())


def _to_complete(node: ir.Node, opsets: dict[str, int]) -> bool:
    """Whether ``node`` is one :func:`_complete_shapes` may give an output shape: an op of
    :data:`_CONSTANT_TARGET_BELOW` below the version given there, whose typed output has no shape."""
    below = _CONSTANT_TARGET_BELOW.get(node.op_type)
    if below is None or node.domain not in ("", "ai.onnx") or not node.outputs:
        return False
    out = node.outputs[0]
    if out.shape is not None or out.type is None:
        return False
    from mograph.shapes import node_version

    version = node_version(node, opsets)
    return version is not None and version < below


def _complete_shapes(model: ir.Model) -> bool:
    """Give each output that ONNX inference left without a shape, of a node :data:`_CONSTANT_TARGET_BELOW`
    names at a version below the one given there, the dims the built-in shape rules prove
    (:class:`mograph.shapes.ShapeQuery`: the target's elements tracked through ``Shape``/``Gather``/
    ``Concat``/..., ``0`` and ``-1`` resolved as ``Reshape`` resolves them): a literal or a named input dim
    as itself, any other dim unnamed.  Main graph only.  Whether any value got a shape."""
    from mograph.shapes import ShapeQuery, as_ir_shape

    graph = model.graph
    opsets = dict(graph.opset_imports)
    if not _old_default_opset(opsets):
        return False  # no node of the default domain is below those versions: no walk of the graph
    todo = [node.outputs[0] for node in graph if _to_complete(node, opsets)]
    if not todo:
        return False
    query = ShapeQuery(graph)
    filled = False
    for out in todo:
        dims = query.dims(out)
        if dims is not None:
            out.shape = as_ir_shape(dims)
            filled = True
    return filled


def _walk(graphs: list[ir.Graph]) -> tuple[list[object], TypeSnapshot, list[int]]:
    """One walk over ``graphs``: the objects that make them up, in order (compared by identity: an edit
    replaces one), each value's type and shape (graph inputs, initializers, node outputs), and where each
    node's part of the structure begins (a node's part ends where the next one's begins, the last at the end)."""
    structure: list[object] = []
    snapshot: TypeSnapshot = []
    marks: list[int] = []
    add, extend, keep, mark = structure.append, structure.extend, snapshot.append, marks.append
    for graph in graphs:
        inputs = graph.inputs
        add(graph)
        extend(inputs)
        add(None)
        extend(graph.outputs)
        add(None)
        for v in inputs:
            keep((v, v.type, v.shape))
        for v in graph.initializers.values():
            add(v)
            add(v.const_value)
            keep((v, v.type, v.shape))
        for node in graph:
            outputs = node.outputs
            mark(len(structure))
            add(node)
            extend(node.inputs)
            add(None)
            extend(outputs)
            add(None)
            attributes = node.attributes  # its own dict's values: a UserDict's view yields each through two Python calls
            extend(attributes.data.values() if isinstance(attributes, UserDict) else attributes.values())
            add(None)
            for v in outputs:
                keep((v, v.type, v.shape))
    return structure, snapshot, marks


def _same_objects(a: list[object], b: list[object]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _same_types(before: list[tuple[Any, Any]], snapshot: TypeSnapshot) -> bool:
    return len(before) == len(snapshot) and all(
        (t is t2 or t == t2) and (sh is sh2 or sh == sh2) for (t, sh), (_, t2, sh2) in zip(before, snapshot)
    )


def _typed_from_tensor(v: ir.Value) -> Any:
    """Give initializer ``v`` its tensor's shape and dtype where they are not recorded; return the tensor (or None)."""
    tensor = v.const_value
    if tensor is not None:
        if v.shape is None:
            v.shape = tensor.shape  # type: ignore[assignment]
        if v.dtype is None:
            v.dtype = tensor.dtype
    return tensor


def _infer_flat(model: ir.Model, data_prop: bool = True) -> None:
    """ONNX shape inference on a model without subgraphs, merged into its values in place.

    Large initializers go to ONNX as typed graph inputs without their data (as onnx_ir's own pass
    does), so no weight is copied; only the types that inference changed are read back.
    """
    import onnx

    graph = model.graph
    inits = list(graph.initializers.values())
    n_inputs = len(graph.inputs)
    is_input = set(graph.inputs)
    hidden: list[tuple[ir.Value, Any]] = []
    for v in inits:
        tensor = _typed_from_tensor(v)
        if tensor is None or tensor.nbytes > _BIG_TENSOR_BYTES:
            hidden.append((v, tensor))
    try:
        for v, _ in hidden:
            if v not in is_input:
                graph.inputs.append(v)
            v.const_value = None
            graph.initializers.pop(v.name)  # type: ignore[arg-type]
        proto = serialize_model(model)
    finally:
        for v, tensor in hidden:
            v.const_value = tensor
            graph.initializers.add(v)
        if hidden and list(graph.initializers.values()) != inits:  # re-added at the end: the original order back
            for v in inits:
                graph.initializers.pop(v.name)  # type: ignore[arg-type]
            for v in inits:
                graph.initializers.add(v)
        while len(graph.inputs) > n_inputs:
            graph.inputs.pop()
    # The types sent, as messages: comparing messages costs a fifth of serializing each type to compare bytes
    # (a second per inference at 100k nodes), and a type equal to the one sent reads back as the value has it.
    sent = {vi.name: vi.type for vi in [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]}
    inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=data_prop)
    values: dict[str, ir.Value] = {v.name: v for v in graph.inputs if v.name}
    values.update((v.name, v) for v in inits if v.name)
    for node in graph:
        for v in node.outputs:
            if v.name:
                values[v.name] = v
    for vi in [*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info]:
        value = values.get(vi.name)
        if value is None or sent.get(vi.name) == vi.type:
            continue
        found = ir.serde.deserialize_value_info_proto(vi, None)
        if found.shape is not None and value.shape != found.shape:
            value.shape = found.shape
        if found.dtype is not None and value.dtype != found.dtype:
            value.dtype = found.dtype


def _in_order(graph: ir.Graph) -> dict[ir.Node, int] | None:
    """Each node's position in ``graph``, or ``None`` unless every input of every node is a graph input, an
    initializer or the output of a node before it (the order ONNX inference needs to see each producer first)."""
    position: dict[ir.Node, int] = {}
    inputs = set(graph.inputs)
    initializers = graph.initializers
    for i, node in enumerate(graph):
        for v in node.inputs:
            if v is None:
                continue
            producer = v.producer()
            if producer is None:
                if v not in inputs and (v.name is None or initializers.get(v.name) is not v):
                    return None
            elif position.get(producer, i) >= i:
                return None
        position[node] = i
    return position


#: Ops whose ONNX data propagation can give an output value data (``generated_shape_data``) that later nodes'
#: inference reads (ONNX 1.23's ``PartialDataPropagationFunction`` s): the first two from the input's shape alone,
#: ``Add``/``Sub``/``Mul`` from both inputs' data, the rest from their inputs' data.
_DATA_FROM_SHAPE = frozenset({"Shape", "Size"})
_DATA_FROM_BOTH = frozenset({"Add", "Sub", "Mul"})
_DATA_FROM_ANY = frozenset({"Cast", "Concat", "Gather", "Slice", "Squeeze", "Unsqueeze"})


def _may_carry_data(value: ir.Value, graph: ir.Graph, memo: dict[ir.Value, bool]) -> bool:
    """Whether ONNX inference of ``graph`` (as :func:`_infer_flat` sends it) may know ``value``'s data: a small
    initializer (sent with its data), a ``Constant``'s output, or an output of a data-propagating op (above)
    whose inputs may carry data.  Over-approximates (any domain, any dtype)."""
    stack = [value]
    while stack:
        v = stack[-1]
        if v in memo:
            stack.pop()
            continue
        producer = v.producer()
        if producer is None:
            tensor = v.const_value if v.name is not None and graph.initializers.get(v.name) is v else None
            memo[v] = tensor is not None and tensor.nbytes <= _BIG_TENSOR_BYTES
            stack.pop()
            continue
        op = producer.op_type
        if op == "Constant" or op in _DATA_FROM_SHAPE:
            memo[v] = True
            stack.pop()
            continue
        if op not in _DATA_FROM_BOTH and op not in _DATA_FROM_ANY:
            memo[v] = False
            stack.pop()
            continue
        ins = [i for i in producer.inputs if i is not None]
        todo = [i for i in ins if i not in memo]
        if todo:
            stack.extend(todo)
            continue
        known = [memo[i] for i in ins]
        memo[v] = (all(known) and len(known) >= 2) if op in _DATA_FROM_BOTH else any(known)
        stack.pop()
    return memo[value]


_MISSING = object()


def _node_segments(structure: list[Any], marks: list[int]) -> dict[ir.Node, tuple[int, int]]:
    """Where each node's part of a :func:`_walk` structure of one graph begins and ends (``marks``: the walk's)."""
    ends = [*marks[1:], len(structure)]
    return {structure[i]: (i, j) for i, j in zip(marks, ends)}  # type: ignore[misc]


def _confirmed_by_region(model: ir.Model, cached: tuple[Any, ...], structure: list[object],
                         snapshot: TypeSnapshot, marks: list[int]) -> bool:
    """Whether a whole-model inference of ``model`` (flat: one graph) would change no value's type, shown by
    inferring only the nodes that changed since the last one (``cached``); ``False`` when that cannot be shown.

    The last inference completed on a graph in order (``cached[4]``), so it is a fixed point: a node whose inputs
    have the types and the data (initializers, ``Constant`` s, ONNX's data propagation) they had then infers the
    types its outputs have now, merged into them unchanged.  The nodes that may infer otherwise are the *region*:
    new nodes, nodes whose inputs, outputs or attributes are other objects, and nodes that read or write a value
    that is new or whose type differs from what that inference left (an edit of a type, a graph input's).  ONNX
    infers the region alone, as :func:`_infer_flat` sends the whole model: its outside inputs as typed inputs (a
    small initializer with its data, a large one without, a ``Constant`` feeding it as the node itself), its
    outputs' types as value infos, the model's opsets and functions.  Where every output of the region infers the
    type it has, the graph is a fixed point as it is, and the whole-model inference would change nothing (the
    nodes after the region see the same types and data as before).  Not shown, and the caller runs the
    inference, when: the graph is out of order or has a dangling input, the graph inputs changed, an outside
    input of the region may carry data ONNX propagated (:func:`_may_carry_data`) or has no type, a value the
    region makes and something outside reads may carry data, an output of the region is unnamed or would get a
    type it does not have, or ONNX fails on the region."""
    old_structure, _, old_after, old_values, context, old_marks = cached
    if context is None or context[0] != model.ir_version:
        return False
    graph = model.graph
    old_opsets, opsets = context[1], model.opset_imports
    old_functions, functions = context[2], model.functions
    # nodes of a domain whose opset changed since, or calling a function added, removed or replaced since: their
    # inference is another (a function's body is read with the model's opsets: any change of one counts for all)
    domains = {d for d in {*old_opsets, *opsets} if old_opsets.get(d) != opsets.get(d)}
    calls = {k for k in {*old_functions, *functions} if old_functions.get(k) is not functions.get(k)}
    if domains and functions:
        calls.update(functions)
    n_in = len(graph.inputs)
    # The header: [graph, *inputs, None, *outputs, None]; the graph inputs must be the same objects.
    if not _same_objects(old_structure[:n_in + 2], structure[:n_in + 2]):
        return False
    position = _in_order(graph)
    if position is None:
        return False
    for v in graph.initializers.values():  # what :func:`_infer_flat` does first
        _typed_from_tensor(v)
    old_types = dict(zip(old_values, old_after))
    changed: set[ir.Value] = set()
    for v, _, _ in snapshot:
        was = old_types.get(v)
        t, sh = v.type, v.shape
        if was is None or not ((t is was[0] or t == was[0]) and (sh is was[1] or sh == was[1])):
            changed.add(v)
    old_header = old_structure.index(None, old_structure.index(None, 1) + 1) + 1
    header = structure.index(None, structure.index(None, 1) + 1) + 1
    old_nodes = _node_segments(old_structure, old_marks)
    old_inits_end = old_marks[0] if old_marks else len(old_structure)
    inits_end = marks[0] if marks else len(structure)
    old_inits = {old_structure[i]: old_structure[i + 1] for i in range(old_header, old_inits_end, 2)}
    for i in range(header, inits_end, 2):
        if old_inits.get(structure[i], _MISSING) is not structure[i + 1]:  # a new initializer, or new data
            changed.add(structure[i])  # type: ignore[arg-type]
    # The nodes that read or write a changed value (a node's inputs are the values it is a user of, its outputs
    # those it produces): found from the changed values, not by testing every node's inputs and outputs.
    touched: set[ir.Node] = set()
    for v in changed:
        producer = v.producer()
        if producer is not None:
            touched.add(producer)
        touched.update(user for user, _ in v.uses())
    region: list[ir.Node] = []
    ends = [*marks[1:], len(structure)]
    is_ = operator.is_
    for s, e in zip(marks, ends):
        node: ir.Node = structure[s]  # type: ignore[assignment]
        old = old_nodes.get(node)
        if (node in touched or old is None or old[1] - old[0] != e - s
                or not all(map(is_, old_structure[old[0]:old[1]], structure[s:e]))
                or (calls and (node.domain, node.op_type, node.overload) in calls)
                or (domains and (node.domain in domains or (node.domain == "" and "ai.onnx" in domains)
                                 or (node.domain == "ai.onnx" and "" in domains)))):
            region.append(node)
    if not region:
        return True
    applied: list[tuple[ir.Value, Any, Any]] = []  # (value, type, shape) before a type the region inferred
    try:
        shown = _infer_region(model, graph, region, position, applied)
        # a node of the region that :func:`run_shape_inference` would complete after ONNX: not shown by ONNX alone
        shown = shown and not (_old_default_opset(graph.opset_imports)
                               and any(_to_complete(node, graph.opset_imports) for node in region))
    finally:
        if not shown:
            for v, t, sh in reversed(applied):
                v.type, v.shape = t, sh
    return shown


def _infer_region(model: ir.Model, graph: ir.Graph, region: list[ir.Node], position: dict[ir.Node, int],
                  applied: list[tuple[ir.Value, Any, Any]]) -> bool:
    """:func:`_confirmed_by_region`'s inference of the region, grown by the readers of each value whose type it
    changes (a new value made without a type) until no output of the region changes or every reader of a changed
    value is already in it (one inference then saw the changed types reach their readers: a second, with them
    sent, would confirm them); each change is applied as :func:`_infer_flat` applies it and recorded in
    ``applied``.  A change is taken only if each named dim it brings is one the region's model already has: a name
    ONNX makes up (``unk__N``) is numbered in the order of the whole model's inference, which the region's does not
    follow."""
    import onnx

    memo: dict[ir.Value, bool] = {}
    members = set(region)
    for _ in range(len(graph) + 1):
        made = {v for node in region for v in node.outputs}
        for node in region:
            for v in node.outputs:
                if not v.name:
                    return False
                if any(user not in members for user, _ in v.uses()) and _may_carry_data(v, graph, memo):
                    return False
        extra: list[ir.Node] = []  # the Constants feeding the region from outside
        outside: list[ir.Value] = []
        seen: set[ir.Value] = set()
        for node in region:
            for read in node.inputs:
                if read is None or read in made or read in seen:
                    continue
                seen.add(read)
                producer = read.producer()
                if producer is not None and producer.op_type == "Constant" and producer.domain in ("", "ai.onnx"):
                    if producer not in members:
                        extra.append(producer)
                    continue
                if read.type is None:
                    return False
                if producer is not None and _may_carry_data(read, graph, memo):
                    return False
                outside.append(read)
        proto = _region_proto(model, sorted([*region, *extra], key=position.__getitem__), outside)
        if proto is None:
            return False
        gp = proto.graph
        sent = {vi.name: vi.type for vi in [*gp.input, *gp.output, *gp.value_info]}
        try:
            inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
        except Exception:  # noqa: BLE001 - not shown: the whole-model inference decides
            logger.debug("region inference failed", exc_info=True)
            return False
        by_name = {v.name: v for v in made}
        changes = [(by_name[vi.name], vi) for vi in [*inferred.graph.input, *inferred.graph.output,
                                                      *inferred.graph.value_info]
                   if vi.name in by_name and sent.get(vi.name) != vi.type]
        if not changes:
            return True
        known = {d.dim_param for t in sent.values() if t.HasField("tensor_type")
                 for d in t.tensor_type.shape.dim if d.dim_param}
        readers: list[ir.Node] = []
        for value, vi in changes:
            t = vi.type
            if not t.HasField("tensor_type") or any(
                    d.dim_param and d.dim_param not in known for d in t.tensor_type.shape.dim):
                return False
            found = ir.serde.deserialize_value_info_proto(vi, None)
            applied.append((value, value.type, value.shape))
            if found.shape is not None and value.shape != found.shape:
                value.shape = found.shape
            if found.dtype is not None and value.dtype != found.dtype:
                value.dtype = found.dtype
            readers.extend(user for user, _ in value.uses() if user not in members)
        if not readers:
            # Every reader of a changed value is in the region, which ONNX just inferred with the changed types
            # flowing from node to node: inferred again with them sent, it would find each type as it now is.
            return True
        for user in readers:
            if user not in members:
                members.add(user)
                region.append(user)
    return False


def _region_proto(model: ir.Model, nodes: list[ir.Node], outside: list[ir.Value]) -> Any:
    """The model :func:`_confirmed_by_region` infers: ``nodes`` (in graph order), the values in ``outside`` as
    :func:`_infer_flat` sends them (a small initializer with its data, a large one as a typed input, any other
    value as a typed input), the value infos of the nodes' typed outputs (the main graph's outputs as outputs),
    and the model's other fields as :func:`serialize_model` writes them.  ``None`` where a value cannot be sent
    as the whole model sends it (a small initializer that is also a graph input)."""
    graph = model.graph
    empty = ir.Graph((), (), nodes=(), opset_imports=graph.opset_imports)
    model.graph = empty
    try:
        proto = ir.serde.serialize_model(model)
    finally:
        model.graph = graph
    gp = proto.graph
    if not (model.functions and model.ir_version < 9):  # the functions' value infos stay in the main graph below 9
        gp.Clear()
    inputs = set(graph.inputs)
    fast = _value_writer()

    def value_into(vi: Any, v: ir.Value) -> None:
        try:
            fast(vi, v)
        except _Unusual:
            vi.Clear()
            ir.serde.serialize_value_into(vi, v)

    for v in outside:
        tensor = v.const_value if v.name is not None and graph.initializers.get(v.name) is v else None
        if tensor is not None and tensor.nbytes <= _BIG_TENSOR_BYTES:
            if v in inputs:
                return None
            value_into(gp.value_info.add(), v)
            tp = gp.initializer.add()
            ir.serde.serialize_tensor_into(tp, tensor)
            tp.name = v.name
        else:
            value_into(gp.input.add(), v)
    typed = []
    for node in nodes:
        if getattr(node, "device_configurations", None):
            return None
        try:
            _node_into(gp.node.add(), node)
        except _Unusual:
            return None
        for out in node.outputs:
            if out.is_graph_output():
                typed.append(out)
            elif out.type is not None or out.shape is not None:
                value_into(gp.value_info.add(), out)
    for out in typed:
        value_into(gp.output.add(), out)
    return proto


class _Unusual(Exception):
    """Raised by :func:`serialize_model` on a part it leaves to onnx_ir's serializer."""


_QUANT_ANNOTATION = "quant_parameter_tensor_names"  # onnx_ir's key in Value.meta for quantization annotations


def serialize_model(model: ir.Model) -> Any:
    """``ir.serde.serialize_model(model)``, faster on a large graph: the same message, byte for byte.

    Most of onnx_ir's time on a large graph goes to the value infos, each type and shape written field by field,
    and a graph has few distinct (type, shape) pairs: here each pair's ``TypeProto`` is written once, by onnx_ir's
    own ``serialize_type_into`` and ``serialize_shape_into``, and copied into every value info that has it.  The
    rest of the graph is written as ``serialize_graph_into`` writes it (the nodes' names in one call each, their
    attributes by onnx_ir's own functions, an ``ir.Tensor``'s fields as onnx_ir writes them, other tensors by
    onnx_ir), and the model's other fields by onnx_ir's ``serialize_model`` on the model with an empty graph.
    Metadata (sorted by key) and doc strings are written as onnx_ir writes them.  Anything unusual (a quantization
    annotation, a node's device configurations, a value without a name, a type other than a tensor type, a dim
    other than an int or a ``SymbolicDim``, an initializer without a value, functions of an IR version below 9,
    whose value infos go to the main graph) sends the whole model to onnx_ir's ``serialize_model``; subgraphs (in
    attributes) are onnx_ir's own.  Used where the pipeline serializes a whole model: the inferences, the output
    check, the spill and the save.  ``tests/core/test_scaling.py`` compares the bytes with onnx_ir's on unusual
    values, a stack and the corpus."""
    if model.functions and model.ir_version < 9:
        return ir.serde.serialize_model(model)
    graph = model.graph
    empty = ir.Graph((), (), nodes=(), opset_imports=graph.opset_imports)  # the model's opsets are its graph's
    model.graph = empty
    try:
        proto = ir.serde.serialize_model(model)
    finally:
        model.graph = graph
    try:
        _serialize_graph_into(proto.graph, graph)
    except _Unusual:
        return ir.serde.serialize_model(model)
    return proto


def _value_writer() -> Callable[[Any, ir.Value], None]:
    """A function that writes a value's info (``ValueInfoProto``) as ``ir.serde.serialize_value_into`` does, each
    distinct type and shape written once (a ``TypeProto`` kept by what is written, copied into each value info
    that has it); it raises :class:`_Unusual` on a value it leaves to onnx_ir (no name, a non-tensor type, a dim
    other than an int or a ``SymbolicDim``)."""
    import onnx

    types: dict[tuple[Any, ...], onnx.TypeProto] = {}
    tensor_type, symbolic = ir.TensorType, ir.SymbolicDim

    def value_into(vi: onnx.ValueInfoProto, v: ir.Value) -> None:
        type_, shape = v.type, v.shape
        if type(type_) is not tensor_type or v.name is None:
            raise _Unusual
        vi.name = v.name
        props = v.metadata_props  # (onnxscript's folder leaves its ``folded_from`` on the values it folds)
        for k in sorted(props):
            vi.metadata_props.add(key=k, value=props[k])
        if v.doc_string:
            vi.doc_string = v.doc_string
        dtype, denoted = type_.dtype, type_.denotation
        if shape is None:
            key: tuple[Any, ...] = (None, dtype, denoted)  # no shape: not the scalar's []
        else:
            if type(shape) is not ir.Shape:
                raise _Unusual
            denotation = shape.get_denotation
            dims: list[Any] = [len(shape), dtype, denoted]
            for i, d in enumerate(shape.dims):
                if type(d) is int:
                    dims.append(d)
                elif type(d) is symbolic:
                    dims.append(None if d.value is None else ("", str(d.value)))
                else:
                    raise _Unusual
                dims.append(denotation(i))
            key = tuple(dims)
        tp = types.get(key)
        if tp is None:  # written as ``serialize_type_into`` and ``serialize_shape_into`` write a tensor type
            tp = types[key] = onnx.TypeProto()
            if denoted:
                tp.denotation = denoted
            tensor = tp.tensor_type
            tensor.elem_type = dtype.value
            if shape is not None:
                tensor.shape.ClearField("dim")  # an empty shape (a scalar) is still written
                add_dim = tensor.shape.dim.add
                for j in range(3, len(key), 2):
                    dim, dim_denotation = key[j], key[j + 1]
                    proto = add_dim()
                    if dim_denotation:
                        proto.denotation = dim_denotation
                    if type(dim) is int:
                        proto.dim_value = dim
                    elif dim is not None:
                        proto.dim_param = dim[1]
        vi.type.CopyFrom(tp)

    return value_into


def _node_into(np_: Any, node: ir.Node) -> None:
    """Write ``node`` as ``ir.serde.serialize_node_into`` writes a node without device configurations (the
    caller checks), its names in one call each; :class:`_Unusual` on a value without a name."""
    np_.op_type = node.op_type
    if node.domain:
        np_.domain = node.domain
    if node.name:
        np_.name = node.name
    if node.overload:
        np_.overload = node.overload
    if node.doc_string:
        np_.doc_string = node.doc_string
    props = node.metadata_props
    for k in sorted(props):
        np_.metadata_props.add(key=k, value=props[k])
    names = ["" if v is None else v.name for v in node.inputs]
    outputs = node.outputs
    last = len(outputs)
    while last and not outputs[last - 1].name:  # trailing outputs without a name are not written
        last -= 1
    names_out = [v.name for v in outputs[:last]]
    if None in names or None in names_out:
        raise _Unusual  # onnx_ir's error, from its own serializer
    np_.input.extend(names)
    np_.output.extend(names_out)
    attr_into, ref_into = ir.serde.serialize_attribute_into, ir.serde.serialize_reference_attribute_into
    for attr in node.attributes.values():
        if attr.is_ref():
            ref_into(np_.attribute.add(), from_=attr)
        else:
            attr_into(np_.attribute.add(), from_=attr)


def _serialize_graph_into(gp: Any, graph: ir.Graph) -> None:
    """``ir.serde.serialize_graph_into`` in the same order, with each distinct type and shape written once."""
    gp.Clear()
    value_into = _value_writer()

    def annotated(v: ir.Value) -> bool:  # a quantization annotation (``in`` first: ``get`` raises on a miss)
        meta = v.meta
        return _QUANT_ANNOTATION in meta and bool(meta[_QUANT_ANNOTATION])

    def wants_info(v: ir.Value) -> bool:  # onnx_ir's test
        return bool(v.name) and (v.type is not None or v.shape is not None or bool(v.metadata_props)
                                 or bool(v.doc_string))

    if graph.name:
        gp.name = graph.name
    if graph.doc_string:
        gp.doc_string = graph.doc_string
    initializers, add_init, plain = graph.initializers, gp.initializer.add, ir.Tensor
    for v in graph.inputs:
        if annotated(v):
            raise _Unusual
        value_into(gp.input.add(), v)
    input_names = {v.name for v in graph.inputs}
    for v in initializers.values():
        if annotated(v):
            raise _Unusual
        if wants_info(v) and v.name not in input_names:
            value_into(gp.value_info.add(), v)
        tensor = v.const_value
        if tensor is None:
            raise _Unusual  # onnx_ir warns and skips it
        tensor.name = v.name
        tp = add_init()
        if type(tensor) is not plain:  # external, string, proto-backed, lazy: onnx_ir's own
            ir.serde.serialize_tensor_into(tp, from_=tensor)
            continue
        tp.name = tensor.name  # as ``serialize_tensor_into`` writes an ``ir.Tensor`` (without its isinstance tests)
        if tensor.doc_string:
            tp.doc_string = tensor.doc_string
        tp.data_type = tensor.dtype.value
        tp.dims.extend(tensor.shape.numpy())
        tp.raw_data = tensor.tobytes()
        props = tensor.metadata_props
        for k in sorted(props):
            tp.metadata_props.add(key=k, value=props[k])
    add_node, add_info = gp.node.add, gp.value_info.add
    for node in graph:  # as ``serialize_node_into`` writes a node without device configurations
        if getattr(node, "device_configurations", None):
            raise _Unusual
        _node_into(add_node(), node)
        for out in node.outputs:
            if out.is_graph_output():
                continue
            if annotated(out):
                raise _Unusual
            if wants_info(out):
                value_into(add_info(), out)
    for v in graph.outputs:
        if annotated(v):
            raise _Unusual
        value_into(gp.output.add(), v)
    props = graph.metadata_props
    for k in sorted(props):
        gp.metadata_props.add(key=k, value=props[k])


def restore_types(snapshot: TypeSnapshot) -> None:
    """Put back the types and shapes :func:`infer_types` found."""
    for value, type_, shape in snapshot:
        value.type, value.shape = type_, shape
