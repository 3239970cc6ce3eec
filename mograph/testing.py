"""The five checks every pass test makes, for built-in and third-party passes alike.

A pass test (a built-in's or a plugin's) shows five things: (1) the op types left after the pass, (2) the exact counts in
``stats``, (3) numerical agreement with the original on seeded feeds, ONNX Runtime optimizations
**off**, tolerance by dtype, (4) a near-miss graph left untouched (``modified`` is False, graph
unchanged), (5) a second run that changes nothing.  :func:`check_pass` does 1, 2, 3 and 5 in one call;
:func:`assert_untouched` does 4::

    from mograph.testing import assert_untouched, check_pass, parse

    model = check_pass(MyPass(), parse(TEXT), stats={"MyRule": 1}, ops_left=["Relu"])

A pass may be a :class:`Pipeline` of several (a fusion and the ``lower`` step, say): their stats are
merged and ``modified`` is true if any changed the model.  Installed as a pytest plugin (entry point
``pytest11``), it also gives the fixture ``mograph_testing`` (this module).  Needs onnxruntime for the
numeric check: without it, the tests that call :func:`run_ort` or :func:`check_pass` are skipped (no
``importorskip`` needed in the tests).

Like :func:`mograph.run_passes`, these helpers are a composition root: a pass made by hand (no
``registry``) is given the current environment's registry before it runs, as
:meth:`mograph.plugins.Registry.instantiate` would have done.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir

from mograph.pass_infra import Pass, PassResult, call_pass, graph_fingerprint

__all__ = [
    "Pipeline",
    "assert_close",
    "assert_untouched",
    "check_pass",
    "feeds_for",
    "if_decisions",
    "op_counts",
    "op_types",
    "parse",
    "run_ort",
    "run_pass",
    "to_ir",
    "to_proto",
    "tolerance_for",
    "with_registry",
]


def with_registry(pass_obj: Pass | Pipeline) -> Pass | Pipeline:
    """``pass_obj`` (each pass of a :class:`Pipeline`), given the current registry where it has none."""
    from mograph.plugins import get_registry

    if isinstance(pass_obj, Pipeline):  # (pipelines nest: a lowered fusion is a Pipeline inside one)
        for p in pass_obj.passes:
            with_registry(p)
    elif pass_obj.registry is None:
        pass_obj.registry = get_registry()
    return pass_obj


class Pipeline:
    """Several passes run in order as one: stats merged (later keys add to earlier ones), details by pass."""

    def __init__(self, *passes: Pass) -> None:
        self.passes = list(passes)
        self.name = ",".join(p.name for p in self.passes)

    def call(self, model: ir.Model) -> PassResult:
        stats: dict[str, int | float] = {}
        details: dict[str, Any] = {}
        modified = False
        with_registry(self)
        for p in self.passes:
            result = p.call(model) if isinstance(p, Pipeline) else call_pass(p, model)
            modified = modified or result.modified
            for key, value in result.stats.items():
                stats[key] = stats.get(key, 0) + value
            details.update(result.details)
            details[p.name] = result.details
        return PassResult(modified=modified, stats=stats, details=details)

    def __repr__(self) -> str:
        return f"Pipeline({', '.join(map(repr, self.passes))})"


def parse(text: str) -> onnx.ModelProto:
    """A checked model from ONNX textual syntax (``<ir_version: 8, opset_import: ["" : 17]> graph (...) {...}``)."""
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model)
    return model


def to_ir(proto: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(proto)


def to_proto(model: ir.Model, *, with_data: bool = False) -> onnx.ModelProto:
    """``model`` as a proto; ``with_data`` inlines external tensors (the model itself is left as it was)."""
    if not with_data:
        return ir.serde.serialize_model(model)
    external = [v for g in model.graphs() for v in g.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)]
    saved = [v.const_value for v in external]
    try:
        for v in external:
            v.const_value = ir.Tensor(np.array(v.const_value.numpy()), name=v.name)  # type: ignore[union-attr]
        return ir.serde.serialize_model(model)
    finally:
        for v, tensor in zip(external, saved):
            v.const_value = tensor


def op_types(model: ir.Model) -> list[str]:
    """The main graph's op types in order, ``domain.op`` outside the default domain."""
    return [f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in model.graph]


def op_counts(model: ir.Model) -> Counter:
    return Counter(op_types(model))


def feeds_for(proto: onnx.ModelProto, seed: int = 0, dims: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Seeded random feeds for the model's inputs: symbolic dims from ``dims`` (default 3), ints below ``dims["vocab"]``."""
    rng = np.random.default_rng(seed)
    dims = dims or {}
    inits = {i.name for i in proto.graph.initializer}
    out = {}
    for inp in proto.graph.input:
        if inp.name in inits:
            continue
        t = inp.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param, 3) for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        if np.issubdtype(dtype, np.integer):
            out[inp.name] = rng.integers(0, dims.get("vocab", 50), size=shape).astype(dtype)
        elif dtype == np.bool_:
            out[inp.name] = rng.integers(0, 2, size=shape).astype(dtype)
        else:
            out[inp.name] = (rng.standard_normal(shape) * 2 + 0.3).astype(dtype)
    return out


def run_ort(model: onnx.ModelProto | ir.Model, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Run on ONNX Runtime's CPU provider with its graph optimizations off (they could hide a broken rewrite).

    External data of an ``onnx_ir.Model`` is read in; feeds the model has no input for are left out.
    Without onnxruntime, a test that calls it (or :func:`check_pass`) is skipped, as ``importorskip`` does.
    """
    ort = _onnxruntime()
    proto = to_proto(model, with_data=True) if isinstance(model, ir.Model) else model
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def if_decisions(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[bool]:
    """What each top-level ``If`` of ``model`` decided for ``feeds`` (:func:`run_ort` on a copy whose graph also
    outputs every ``If`` condition), in graph order: which branch a run-time check took."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    conds = [n.input[0] for n in probe.graph.node if n.op_type == "If"]
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(c, onnx.TensorProto.BOOL, []) for c in conds)
    return [bool(x) for x in run_ort(probe, feeds)[-len(conds):]] if conds else []


def _onnxruntime() -> Any:
    """onnxruntime; without it, the running test is skipped (outside a test, the error naming the extra)."""
    try:
        import onnxruntime
    except ImportError:
        if "PYTEST_CURRENT_TEST" in os.environ:  # set by pytest while a test runs
            import pytest

            pytest.skip("onnxruntime is not installed: pip install 'mograph[ort]'")
        from mograph.errors import BackendUnavailableError

        raise BackendUnavailableError("onnxruntime", "ort") from None
    return onnxruntime


def tolerance_for(arrays: Iterable[np.ndarray]) -> float:
    """The default relative tolerance for outputs of these dtypes: 1e-4 for float32/64, 2e-3 for 16-bit floats."""
    sixteen = any(a.dtype in (np.float16,) or a.dtype.name == "bfloat16" for a in arrays)
    return 2e-3 if sixteen else 1e-4


def assert_close(ref: list[np.ndarray], got: list[np.ndarray], rel: float = 1e-4) -> float:
    """Max abs error relative to the output scale (max |ref|, at least 1) must be <= rel; returns the worst."""
    worst = 0.0
    assert len(ref) == len(got), (len(ref), len(got))
    for r, g in zip(ref, got):
        assert r.shape == g.shape, (r.shape, g.shape)
        r64, g64 = r.astype(np.float64), g.astype(np.float64)
        scale = max(1.0, float(np.max(np.abs(r64)))) if r64.size else 1.0
        err = float(np.max(np.abs(r64 - g64))) / scale if r64.size else 0.0
        worst = max(worst, err)
    assert worst <= rel, f"max abs error {worst:.3g} (relative to output scale) > {rel}"
    return worst


def run_pass(pass_obj: Pass | Pipeline, proto: onnx.ModelProto) -> tuple[ir.Model, PassResult]:
    """Run the pass (each pass of a :class:`Pipeline`) on ``proto`` as the pass manager does (:func:`call_pass`)."""
    model = to_ir(proto)
    pass_obj = with_registry(pass_obj)
    return model, pass_obj.call(model) if isinstance(pass_obj, Pipeline) else call_pass(pass_obj, model)


def check_pass(
    pass_obj: Pass | Pipeline,
    proto: onnx.ModelProto,
    *,
    stats: dict[str, int] | None = None,
    ops_left: list[str] | Counter | None = None,
    rel: float | None = None,
    feeds: dict[str, np.ndarray] | None = None,
    second_run: str = "all",
) -> ir.Model:
    """Run the pass on ``proto`` and check: exact stats, ops left, numbers against the original, a no-op second run.

    ``modified`` must be true exactly when ``stats`` has counts.  ``rel`` defaults by the outputs'
    dtypes (:func:`tolerance_for`).  ``second_run`` says what must change nothing when run again:
    ``"all"`` (default) the pass or whole :class:`Pipeline`; ``"last"`` only the pipeline's last pass — for
    a fusion followed by a ``lower`` that gives back the standard ops it fused (run again, the fusion
    would rightly fuse them anew), check ``Pipeline(FusePass(), LowerPass(target="onnx"))`` with
    ``second_run="last"``; ``"none"`` skips it (say why in the test).  Returns the rewritten model.
    """
    if second_run not in ("all", "last", "none"):
        raise ValueError(f"second_run must be 'all', 'last' or 'none', not {second_run!r}")
    feeds = feeds if feeds is not None else feeds_for(proto)
    ref = run_ort(proto, feeds)
    model, result = run_pass(pass_obj, proto)
    if stats is not None:
        assert dict(result.stats.items()) == stats, result.stats
        assert result.modified == bool(stats)
    if ops_left is not None:
        if isinstance(ops_left, Counter):
            assert op_counts(model) == ops_left, op_types(model)
        else:
            assert op_types(model) == ops_left, op_types(model)
    got = run_ort(to_proto(model), feeds)
    assert_close(ref, got, rel if rel is not None else tolerance_for(ref))
    if second_run == "none":
        return model
    rerun = pass_obj.passes[-1] if second_run == "last" and isinstance(pass_obj, Pipeline) else pass_obj
    before = graph_fingerprint(model)
    again = rerun.call(model)
    assert again.modified is False, again.stats
    assert graph_fingerprint(model) == before
    return model


def assert_untouched(pass_obj: Pass | Pipeline, proto: onnx.ModelProto) -> PassResult:
    """A near miss: the pass reports ``modified=False`` and the graph is unchanged."""
    model = to_ir(proto)
    before = graph_fingerprint(model)
    result = with_registry(pass_obj).call(model)
    assert result.modified is False, result.stats
    assert graph_fingerprint(model) == before
    return result


try:  # the pytest plugin (entry point pytest11): a fixture giving this module
    import pytest

    @pytest.fixture
    def mograph_testing() -> Any:
        """The :mod:`mograph.testing` helpers."""
        import mograph.testing

        return mograph.testing
except ImportError:  # pragma: no cover - pytest is only needed to use the fixture
    pass
