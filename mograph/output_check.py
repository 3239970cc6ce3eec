"""The check every pipeline's output gets: a model mograph writes is one that loads.

Why: a pass can produce a graph that looks right to it and that no runtime accepts (a float16 input
an operator only takes as float32, ``If`` branches whose outputs disagree in type, a Q/DQ form the
opset does not have).  Numeric verification would catch it, but only when asked; this check always
runs after the last pass (:func:`mograph.api.run_passes`), so an invalid model is a pass error, never
a file written with exit status 0.

What is checked:

0. the graph has at least one output (the ONNX checker accepts a graph with none; the loader refuses
   such an input, so a pass must not make one);
1. the ONNX checker (``onnx.checker.check_model``, no shape inference) on a skeleton of the model in
   which tensors above :data:`PLACEHOLDER_BYTES` are stand-ins, so no weight is copied or read (for a
   model ONNX Runtime is given as a spilled file, a copy of that file's proto, whose large tensors are
   references to their data: the graph is serialized once for both steps).
   Default-domain nodes that ONNX Runtime runs with a kernel of its own where ONNX has no schema at
   the model's opset (``LayerNormalization`` below 17, ``SimplifiedLayerNormalization`` at any opset:
   what the ``ort`` lowering writes) are hidden from the checker; which ones those are is asked of
   ONNX Runtime itself (:func:`ort_default_domain_ops`, its registered CPU kernels), and ONNX
   Runtime's load (step 2) checks them.  Without ``onnxruntime`` the answer is
   :data:`ORT_DEFAULT_DOMAIN_OPS_FALLBACK` (the forms mograph's ``ort`` lowering writes), and the
   result says those nodes were not checked by anything;
2. a load in ONNX Runtime (CPU, graph optimizations **off**, so the graph loaded is the graph
   written; weight prepacking off, so the load holds no second copy of the weights; memory pattern off, whose
   planner is quadratic in the number of initializers: :func:`_ort_check_options`), when ``onnxruntime`` is importable, every node's domain is one ONNX Runtime knows
   (``""``/``ai.onnx``, ``com.microsoft``, ``ai.onnx.ml``) or a model-local function, and the weights
   are at most :data:`ORT_MAX_BYTES` in all (a session holds them: above that, the load would cost as
   much memory as the model, and only the checker runs).  External data is not copied: the session
   reads it from the folder it was loaded from.  A step that cannot run is reported as skipped, with
   the reason.  A main graph of more than twice :data:`mograph._ort_parts.PART_NODES` nodes is loaded
   in consecutive parts of that many nodes, each declared with the types and shapes ONNX Runtime's
   load of the parts before it inferred (:mod:`mograph._ort_parts`: the session's time grows with the
   square of the nodes, 4.1 CPU-s for a 100k-node graph whose ten 10k-node tenths take 2.2); the result
   says so.

:func:`check_model_output` raises :class:`InvalidModel` (message and the node named by the checker or
ONNX Runtime, when they name one); the API turns it into a pass error naming the pass.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

import onnx_ir as ir

from mograph._traverse import iter_nodes
from mograph.foreign_ops import BUILTIN_FOREIGN_OPS
from mograph.irutil import serialize_model

__all__ = ["InvalidModel", "check_model_output", "ORT_DOMAINS", "ORT_DEFAULT_DOMAIN_OPS_FALLBACK", "ORT_MAX_BYTES",
           "ort_default_domain_ops", "PLACEHOLDER_BYTES"]

logger = logging.getLogger(__name__)

#: Operator domains ONNX Runtime implements (its contrib ops included).
ORT_DOMAINS = frozenset({"", "ai.onnx", "com.microsoft", "ai.onnx.ml"})
#: Used only when ``onnxruntime`` is not installed, so ONNX Runtime cannot be asked: the default-domain ops
#: mograph's ``ort`` lowering writes that ONNX Runtime runs at opsets where ONNX has no schema for them (the
#: foreign-op records that say ``ort_default_domain``).
#: With ``onnxruntime`` installed the set comes from its registered kernels (:func:`ort_default_domain_ops`).
ORT_DEFAULT_DOMAIN_OPS_FALLBACK = frozenset(op.name for op in BUILTIN_FOREIGN_OPS if op.domain == "" and op.ort_default_domain)
#: Largest total of weight bytes (in memory and external) for which the ONNX Runtime load runs.
ORT_MAX_BYTES = 1 << 30
#: Tensors larger than this are replaced by a one-element stand-in for the ONNX checker.
PLACEHOLDER_BYTES = 1024

_NODE_PATTERNS = (
    re.compile(r"in node \(([^)]*)\)"),
    re.compile(r"[Nn]ode \(([^)]+)\)"),
    re.compile(r"Name: ?'?([^'\s]+)'? OpType"),
    re.compile(r"node '([^']+)'"),
    re.compile(r"[Nn]ode:? ?([^\s:,]+) (?:Op|output|input)"),
)


class InvalidModel(Exception):
    """The model fails the ONNX checker or ONNX Runtime refuses to load it.

    Attributes:
        tool: ``"onnx checker"`` or ``"onnxruntime"``.
        node: the node the tool's message names, or ``None``.
        detail: the tool's message, first lines.
    """

    def __init__(self, tool: str, detail: str, node: str | None) -> None:
        where = f" at node '{node}'" if node else ""
        super().__init__(f"{tool} refuses the model{where}: {detail}")
        self.tool = tool
        self.detail = detail
        self.node = node


def _node_in(message: str) -> str | None:
    for pattern in _NODE_PATTERNS:
        m = pattern.search(message)
        if m and m.group(1):
            return m.group(1)
    return None


def _short(message: str, lines: int = 3) -> str:
    text = " ".join(line.strip() for line in str(message).strip().splitlines()[:lines] if line.strip())
    return text[:600]


def _all_values(model: ir.Model, census: Any = None) -> list[ir.Value]:
    """The initializer values of the main graph and its subgraphs, each graph once; ``census``: ``model``'s
    :class:`mograph._spill.Census`, whose graphs are those."""
    if census is None:
        return [v for graph in model.graphs() for v in graph.initializers.values()]
    graphs = dict.fromkeys(census.graphs)  # (onnx_ir's ``Model.graphs`` lists a graph once)
    if len(graphs) == len(census.graphs):
        return census.initializers
    return [v for graph in graphs for v in graph.initializers.values()]


def _placeholder(t: ir.TensorProtocol) -> ir.TensorProtocol:
    """A one-element tensor of ``t``'s type (``t`` itself for a type numpy cannot hold, such as strings)."""
    import numpy as np

    try:
        return ir.tensor(np.zeros((1,), t.dtype.numpy()), dtype=t.dtype)
    except Exception:  # noqa: BLE001 - string tensors and the like stay as they are
        return t


def _big(t: ir.TensorProtocol | None) -> bool:
    return t is not None and (isinstance(t, ir.ExternalTensor) or t.nbytes > PLACEHOLDER_BYTES)


def _skeleton(model: ir.Model, census: Any = None) -> Any:
    """A ``ModelProto`` of ``model`` whose large tensors are one-element stand-ins (nothing big is read).

    The stand-ins are put in place for the serialization only and the model's own tensors put back
    after it (``Model.clone`` cannot copy every valid graph: a branch that outputs an outer value).
    ``census``: ``model``'s :class:`mograph._spill.Census` (no walk of the model here then).
    """
    swapped_values: list[tuple[ir.Value, ir.TensorProtocol]] = []
    swapped_attrs: list[tuple[ir.Node, str, ir.Attr]] = []
    try:
        for value in _all_values(model, census):
            t = value.const_value
            if t is not None and _big(t):
                swapped_values.append((value, t))
                value.const_value = _placeholder(t)
        if census is not None:
            attrs = [(node, attr.name, attr) for node, attr in census.attrs]
        else:
            attrs = [(node, key, attr) for node in iter_nodes(model.graph) for key, attr in node.attributes.items()]
        for node, key, attr in attrs:
            if attr.type == ir.AttributeType.TENSOR and _big(attr.value):
                swapped_attrs.append((node, key, attr))
                node.attributes[key] = ir.AttrTensor(key, _placeholder(attr.value))
        return serialize_model(model)
    finally:
        for value, t in swapped_values:
            value.const_value = t
        for node, key, attr in swapped_attrs:
            node.attributes[key] = attr


def _references_emptied(proto: Any, copy: bool = True) -> Any:
    """A copy of a spilled model's proto whose external tensors are empty in-memory stand-ins (dims
    ``[0]``): the checker reads nothing, and does not look for the data file in the current directory.
    ``copy=False``: ``proto`` itself, edited (for a proto whose file is written and that nothing reads again)."""
    import onnx

    if copy:
        copy_ = onnx.ModelProto()
        copy_.CopyFrom(proto)
        proto = copy_
    graphs = [proto.graph]
    while graphs:
        graph = graphs.pop()
        for t in graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                del t.external_data[:]
                t.data_location = onnx.TensorProto.DEFAULT
                del t.dims[:]
                t.dims.append(0)
                t.raw_data = b""
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("g"):
                    graphs.append(attr.g)
                graphs.extend(attr.graphs)
    return proto


#: Execution providers whose presence does not make ONNX Runtime's kernel listing load provider libraries.
_LISTING_SAFE_PROVIDERS = frozenset({"CPUExecutionProvider", "AzureExecutionProvider"})
#: Seconds the kernel listing may take in its own process (a GPU build's; normally about a second).
LISTING_TIMEOUT_S = 120.0
#: The listing, run in a child process: one ``[op, first, last]`` per default-domain CPU kernel, as JSON.
_LISTING_SCRIPT = (
    "import json\n"
    "from onnxruntime.capi import _pybind_state as c\n"
    "print(json.dumps(sorted({(k.op_name, int(k.version_range[0]), int(k.version_range[1])) for k in "
    "c.get_all_opkernel_def() if k.domain in ('', 'ai.onnx') and k.provider == 'CPUExecutionProvider'})))\n"
)


@functools.lru_cache(maxsize=1)
def _ort_cpu_default_domain_kernels() -> tuple[tuple[str, int, int], ...] | None:
    """``(op_type, first, last opset)`` of every default-domain CPU kernel ONNX Runtime registers, or
    ``None`` when ``onnxruntime`` (or its kernel listing) is not there.

    ``get_all_opkernel_def`` walks every provider of the build, loading their libraries: in an
    ``onnxruntime-gpu`` build whose TensorRT (or CUDA) libraries are not installed, a usual setup, it
    crashes the process (a segmentation fault, seen with onnxruntime-gpu 1.31.1 on an H200 without
    TensorRT and on a machine without CUDA).  So a build with providers beyond the CPU lists its kernels
    in a child process, and a child that fails answers ``None`` (the fallback list)."""
    try:
        import onnxruntime as ort
        from onnxruntime.capi import _pybind_state as ort_c
    except ImportError:
        return None
    listing = getattr(ort_c, "get_all_opkernel_def", None)
    if listing is None:
        return None
    if not set(ort.get_available_providers()) <= _LISTING_SAFE_PROVIDERS:
        return _kernels_in_child()
    try:
        kernels = listing()
    except Exception:  # noqa: BLE001 - an ONNX Runtime build without the listing: fall back
        logger.info("output check: onnxruntime does not list its kernels", exc_info=True)
        return None
    out = set()
    for k in kernels:
        if k.domain in ("", "ai.onnx") and k.provider == "CPUExecutionProvider":
            first, last = k.version_range
            out.add((k.op_name, int(first), int(last)))
    return tuple(sorted(out))


def _kernels_in_child() -> tuple[tuple[str, int, int], ...] | None:
    """:func:`_ort_cpu_default_domain_kernels`'s listing in a child process (same interpreter and path);
    ``None`` when the child fails, crashes or runs past :data:`LISTING_TIMEOUT_S`."""
    import json
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", _LISTING_SCRIPT], capture_output=True, text=True,
                              timeout=LISTING_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.info("output check: onnxruntime's kernel listing did not run (%s): using the fallback list", exc)
        return None
    if done.returncode != 0:
        logger.info("output check: onnxruntime's kernel listing failed in its own process (exit %s): using the "
                    "fallback list", done.returncode)
        return None
    try:
        rows = json.loads(done.stdout.strip().splitlines()[-1])
        return tuple(sorted((str(op), int(first), int(last)) for op, first, last in rows))
    except (ValueError, IndexError, TypeError) as exc:
        logger.info("output check: onnxruntime's kernel listing was not readable (%s): using the fallback list", exc)
        return None


def ort_default_domain_ops(opset: int) -> tuple[frozenset[str], str]:
    """The default-domain ops ONNX Runtime runs at ``opset`` that ONNX has no schema for at that opset,
    and where the answer came from (``"onnxruntime"`` or ``"fallback"``).

    Asked of ONNX Runtime's registered CPU kernels when ``onnxruntime`` is importable (an op counts when
    a kernel's opset range holds ``opset`` and ``onnx.defs`` has no schema of it at ``opset``); else
    :data:`ORT_DEFAULT_DOMAIN_OPS_FALLBACK`.
    """
    import onnx

    kernels = _ort_cpu_default_domain_kernels()
    if kernels is None:
        return ORT_DEFAULT_DOMAIN_OPS_FALLBACK, "fallback"
    out = set()
    for op_type, first, last in kernels:
        if not first <= opset <= last:
            continue
        try:
            onnx.defs.get_schema(op_type, opset, "")
        except onnx.defs.SchemaError:
            out.add(op_type)
    return frozenset(out), "onnxruntime"


def _default_opset(proto: Any) -> int:
    for entry in proto.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    return 1


def _hide_ort_default_domain_ops(proto: Any) -> tuple[Any, list[str], str]:
    """Move the checker's copy's default-domain nodes that ONNX Runtime runs where ONNX has no schema
    (:func:`ort_default_domain_ops`) to ``com.microsoft``, whose nodes the checker has no schemas for
    (ONNX Runtime's load, which follows, checks them).  Returns the copy, the op types moved, and where
    the list of such ops came from."""
    ops, source = ort_default_domain_ops(_default_opset(proto))
    moved: set[str] = set()
    nodes = [*proto.graph.node, *(n for fn in proto.functions for n in fn.node)]
    while nodes:
        node = nodes.pop()
        if node.domain in ("", "ai.onnx") and node.op_type in ops:
            node.domain = "com.microsoft"
            moved.add(node.op_type)
        for attr in node.attribute:
            if attr.HasField("g"):
                nodes.extend(attr.g.node)
            for sub in attr.graphs:
                nodes.extend(sub.node)
    if moved and not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.add(domain="com.microsoft", version=1)
    return proto, sorted(moved), source


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _ort_skip_reason(model: ir.Model, census: Any = None) -> str | None:
    """Why ONNX Runtime's load cannot run, or ``None``; ``census``: ``model``'s :class:`mograph._spill.Census`
    (then the model is not walked here)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return "onnxruntime is not installed"
    local = {(d, n) for d, n, _ in model.functions}
    ops = census.ops if census is not None else {(node.domain, node.op_type) for node in iter_nodes(model.graph)}
    unknown = sorted({
        domain or "ai.onnx" for domain, op_type in ops if domain not in ORT_DOMAINS and (domain, op_type) not in local
    })
    if unknown:
        return f"ops in domain(s) ONNX Runtime does not know: {', '.join(unknown)}"
    if local & set(ops):
        # a TensorRT plugin node (it carries plugin_namespace: mograph.lowering.is_plugin_node) beside a node the
        # target kept as the op of the same name: ONNX Runtime reads the plugin node as a call of that op's
        # function body, whose outputs and attributes are not the plugin's (torchaudio's Emformer RNN-T, two
        # SkipLayerNorms kept among 28 plugins: refused, exit 4, on a model meant for TensorRT alone)
        plugins = sorted({f"{n.domain}.{n.op_type}" for n in iter_nodes(model.graph)
                          if (n.domain, n.op_type) in local and "plugin_namespace" in n.attributes})
        if plugins:
            return (f"TensorRT plugin node(s) {', '.join(plugins)}: ONNX Runtime would read them as the function "
                    "of the op of the same name kept beside them")
    total = sum(v.const_value.nbytes for v in _all_values(model, census) if v.const_value is not None)
    if total > ORT_MAX_BYTES:
        return f"{_size(total)} of weights (load limit {_size(ORT_MAX_BYTES)})"
    folders = _folders(model, census)
    if len(folders) > 1:
        return f"external data in {len(folders)} different folders"
    return None


def _folders(model: ir.Model, census: Any = None) -> set[str]:
    """The folders of every external tensor, tensor attributes too: as bytes, the model's locations would
    otherwise be resolved against the current directory."""
    from mograph import ir_io

    tensors = census.all_external() if census is not None else ir_io.external_tensors(model)
    return {str(t.base_dir) for t in tensors}


def _ort_payload(model: ir.Model, census: Any = None) -> Any:
    """What ONNX Runtime loads (:class:`mograph._spill.Payload`): in-memory tensors past the protobuf limit
    are spilled to a file (:mod:`mograph._spill`).  ``census``: ``model``'s :class:`mograph._spill.Census`."""
    from mograph import _spill

    folders = _folders(model, census)
    return _spill.payload(model, folders.pop() if folders else None, census=census)


def _ort_check_options() -> Any:
    """The ``SessionOptions`` of the check's load: graph optimizations off, weight prepacking off, quiet.

    Optimizations off: the graph ONNX Runtime resolves, type-checks and makes kernels for is the graph
    written, not one its own fusions rewrote first (they could hide a node it would refuse).

    Prepacking off (``session.disable_prepacking``): with it on, each kernel that supports it (MatMul,
    Gemm, Conv, the quantized MatMuls) copies its constant weight into its own layout while the session
    is created; that is a speed step of the CPU kernels, and it costs a second copy of those weights:
    +630 MiB on a 30-layer LLaMA of 622 MiB (peak 2.3x the model, against +33 MiB without).  Off, the
    load still parses the model, resolves the graph (every node's schema or contrib kernel, the types
    between nodes, the initializers), and creates every node's CPU kernel, which is what this check
    proves; what it no longer runs is the kernels' ``PrePack`` copy, which a real session (``bench``,
    ``validate``: they make their own options) still does on its first load.

    Memory pattern off (``enable_mem_pattern``): with it on, the session lays out its initializers in one
    planned buffer, and ONNX Runtime's planner (``MemPatternPlanner``) places each initializer by scanning
    every block placed before it, so the load's time grows with the square of the number of initializers
    (the optimized 100k-node stack of ``tools/bench_core.py``, 20,248 initializers: 5.1 CPU-s with it, 4.2
    without; the 10k one, 2,041 initializers: 0.21 to 0.24 CPU-s either way).  Off, each initializer gets
    its own allocation; the graph resolved and the kernels created are the same.  The pattern is a speed
    step of repeated runs, and this session never runs.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.enable_mem_pattern = False
    so.log_severity_level = 4
    return so


def _ort_load_parts(model: ir.Model, payload: Any) -> int:
    """ONNX Runtime's load of a graph of more than twice :data:`mograph._ort_parts.PART_NODES` nodes, made
    in parts (:mod:`mograph._ort_parts`: the session's time grows with the square of the nodes); the number of
    parts, or ``0`` when the graph is to be loaded whole."""
    import os

    import onnx

    from mograph import _ort_parts, _spill

    if len(model.graph) <= 2 * _ort_parts.PART_NODES:
        return 0
    if payload.path is not None:
        # a spilled model: the parts are given as bytes whose external data is read from the spilled folder
        proto = onnx.load(payload.path, load_external_data=False)
        folder = os.path.dirname(payload.path)
    else:
        proto = onnx.ModelProto.FromString(payload.data)
        folder = payload.folder

    def load(part: Any) -> Any:
        return _spill.Payload(data=part.SerializeToString(), folder=folder).session(
            _ort_check_options(), ["CPUExecutionProvider"])

    return _ort_parts.load_in_parts(proto, load)


def _ort_load(model: ir.Model, payload: Any = None, census: Any = None) -> int:
    """ONNX Runtime's load (step 2 of the module docstring); the number of parts it was made in (1: whole)."""
    payload = payload if payload is not None else _ort_payload(model, census)
    try:
        parts = _ort_load_parts(model, payload)
        if not parts:
            payload.session(_ort_check_options(), ["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types for a refused model
        message = str(exc)
        raise InvalidModel("onnxruntime", _short(message), _node_in(message)) from exc
    return parts or 1


def check_model_output(model: ir.Model) -> dict[str, str]:
    """Check ``model`` (see the module docstring); return what ran (``{"onnx_checker": "passed", ...}``).

    Raises:
        InvalidModel: the checker or ONNX Runtime refuses the model.
    """
    import onnx

    from mograph.ir_version import fit_ir_version

    fit_ir_version(model)  # the IR version it will be written with (mograph.ir_version)
    out: dict[str, str] = {}
    if not model.graph.outputs:  # the checker accepts it; an input with no outputs is refused on load (exit 3)
        raise InvalidModel("output check", "the graph has no outputs: the model computes nothing", None)
    from mograph import _spill

    # One walk answers what the steps below ask about the model's tensors and ops (it is not edited here: the
    # skeleton's stand-ins are put back before ONNX Runtime's load).
    census = _spill.Census.of(model)
    reason = _ort_skip_reason(model, census)
    payload = None
    if reason is None and census.too_big():
        # The spilled file's proto holds every large tensor as a reference to its data already: it is the
        # checker's skeleton, so the graph is serialized once, not twice.  Edited in place, not copied: its file
        # is written (ONNX Runtime loads that), and the payload is this check's own, read by nothing else.
        payload = _ort_payload(model, census)
    if payload is not None and payload.spilled is not None:
        skeleton = _references_emptied(payload.spilled.proto, copy=False)
    else:
        skeleton = _skeleton(model, census)
    skeleton, hidden, source = _hide_ort_default_domain_ops(skeleton)
    try:
        onnx.checker.check_model(skeleton)
    except onnx.checker.ValidationError as exc:
        message = str(exc)
        raise InvalidModel("onnx checker", _short(message), _node_in(message)) from exc
    out["onnx_checker"] = "passed"
    if hidden:
        out["onnx_checker"] = (f"passed (ONNX Runtime's own default-domain ops left to its load: {', '.join(hidden)}; "
                               f"{'listed by onnxruntime' if source == 'onnxruntime' else 'onnxruntime absent: not checked'})")
    del skeleton
    if reason is not None:
        out["onnxruntime"] = f"skipped: {reason}"
        logger.info("output check: ONNX Runtime load skipped (%s)", reason)
        return out
    parts = _ort_load(model, payload, census)
    out["onnxruntime"] = ("passed (loaded, graph optimizations off)" if parts == 1 else
                          f"passed (loaded in {parts} consecutive parts of the graph, graph optimizations off)")
    return out
