"""The ONNX Runtime backend (``ort``): sessions for validation and benchmarking.

onnxruntime is imported lazily, the first time a session is made; when it is missing,
:class:`~mograph.errors.BackendUnavailableError` names the pip extra (``mograph[ort]``).

Two uses, two settings of ONNX Runtime's own graph optimizations:

* **validation** (:mod:`mograph.validate`) runs with them **off** (``ORT_DISABLE_ALL``): ONNX
  Runtime's fusions could otherwise rewrite both the original and a broken optimized model into the
  same fused kernels and hide the breakage;
* **benchmarking** (``mograph bench``) runs with them **on** (``ORT_ENABLE_ALL``), which is what a
  deployment runs, unless asked otherwise.

Models reach ONNX Runtime as bytes when they fit in one protobuf; a model above 2 GB, or one whose
initializers live in external files, is written with external data into a temporary folder that lives
as long as the session, and loaded from the path.

Types numpy does not have (bfloat16, float8) travel as ``ml_dtypes`` arrays: they are passed to and
read back from ONNX Runtime through ``OrtValue`` s, which ``InferenceSession.run`` cannot do itself.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mograph._tempfiles import OwnedTempDir, owned_tempdir
from mograph.backends import Backend, Runner
from mograph.errors import BackendUnavailableError, ModelError, UsageError

__all__ = ["OrtBackend", "BACKEND", "import_ort", "make_session", "run", "ort_version", "needs_file"]

logger = logging.getLogger(__name__)

#: Leave room for the graph itself when deciding whether the initializers fit in one protobuf.
_PROTO_LIMIT = 2**31 - 64 * 2**20

#: ONNX Runtime type strings numpy lacks -> (ml_dtypes name, ONNX TensorProto type, storage dtype).
_EXOTIC = {
    "tensor(bfloat16)": ("bfloat16", onnx.TensorProto.BFLOAT16, np.uint16),
    "tensor(float8e4m3fn)": ("float8_e4m3fn", onnx.TensorProto.FLOAT8E4M3FN, np.uint8),
    "tensor(float8e5m2)": ("float8_e5m2", onnx.TensorProto.FLOAT8E5M2, np.uint8),
}


def import_ort() -> Any:
    """Import onnxruntime, or raise :class:`BackendUnavailableError` naming the ``ort`` extra."""
    try:
        import onnxruntime
    except ImportError as exc:
        raise BackendUnavailableError("onnxruntime", "ort") from exc
    return onnxruntime


def ort_version() -> str:
    return str(import_ort().__version__)


def _initializer_values(model: ir.Model) -> list[ir.Value]:
    out = list(model.graph.initializers.values())
    for sub in model.graph.subgraphs():
        out.extend(sub.initializers.values())
    return out


def needs_file(model: ir.Model) -> bool:
    """Whether ``model`` must reach ONNX Runtime as a file: above 2 GB, or with external tensors."""
    total = 0
    for value in _initializer_values(model):
        tensor = value.const_value
        if tensor is None:
            continue
        if isinstance(tensor, ir.ExternalTensor):
            return True
        total += tensor.nbytes
    return total >= _PROTO_LIMIT


def _save_to_temp(model: ir.Model) -> tuple[str, OwnedTempDir]:
    # A locked folder: removed with the session, on an exception (SIGTERM included, in the CLI), or by
    # the next run if this process is killed outright.
    tmp = owned_tempdir("mograph-ort-")
    try:
        path = os.path.join(tmp.name, "model.onnx")
        ir.save(model, path, external_data="model.onnx.data")
    except BaseException:
        tmp.cleanup()
        raise
    return path, tmp


def _model_payload(model: Any) -> tuple[str | bytes, OwnedTempDir | None]:
    """What ``InferenceSession`` gets: a path or bytes, and the temp folder to keep alive, if any."""
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.is_file():
            raise ModelError(f"{path}: no such file")
        return str(path), None
    if isinstance(model, (bytes, bytearray)):
        return bytes(model), None
    if isinstance(model, onnx.ModelProto):
        if model.ByteSize() < _PROTO_LIMIT:
            return model.SerializeToString(), None
        model = ir.serde.deserialize_model(model)
    if isinstance(model, ir.Model):
        if needs_file(model):
            return _save_to_temp(model)
        try:
            return ir.serde.serialize_model(model).SerializeToString(), None
        except ValueError:  # protobuf refuses messages above 2 GB (large Constant nodes)
            return _save_to_temp(model)
    raise UsageError(f"cannot run a model given as {type(model).__name__}: give a path, bytes, ModelProto or ir.Model")


def make_session(
    model_or_path: Any,
    *,
    optimizations: bool = False,
    threads: int | None = None,
    providers: list[str] | None = None,
) -> Any:
    """Create an ``onnxruntime.InferenceSession``.

    Args:
        model_or_path: a path to an ``.onnx`` file (its external data is read beside it), bytes,
            an ``onnx.ModelProto`` or an ``onnx_ir.Model``.
        optimizations: ONNX Runtime's own graph optimizations: ``False`` (``ORT_DISABLE_ALL``,
            for numeric checks) or ``True`` (``ORT_ENABLE_ALL``, what deployments run).
        threads: intra-op threads (``None``: ONNX Runtime's default, one per core).
        providers: execution providers in priority order (default: CPU only, so numeric checks do
            not depend on the machine's accelerators).

    Raises:
        BackendUnavailableError: onnxruntime is not installed.
        UsageError: a requested execution provider is not available.
        ModelError: ONNX Runtime refuses the model (the message is ONNX Runtime's).
    """
    ort = import_ort()
    opts = ort.SessionOptions()
    opts.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimizations else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    opts.log_severity_level = 3  # errors only: ONNX Runtime's warnings are not ours to print
    if threads is not None:
        if threads < 1:
            raise UsageError(f"threads must be at least 1, not {threads}")
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    providers = list(providers or ["CPUExecutionProvider"])
    missing = [p for p in providers if p not in ort.get_available_providers()]
    if missing:
        raise UsageError(
            f"execution provider(s) {missing} not available in this onnxruntime; "
            f"available: {', '.join(ort.get_available_providers())}"
        )
    payload, tmp = _model_payload(model_or_path)
    try:
        session = ort.InferenceSession(payload, sess_options=opts, providers=providers)
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own unrelated exception types
        if tmp is not None:
            tmp.cleanup()
        raise ModelError(f"ONNX Runtime cannot load the model: {_short(exc)}") from exc
    if tmp is not None:
        session._mograph_tmpdir = tmp  # keep the external data alive as long as the session
    return session


def _short(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    return text if len(text) <= 600 else text[:600] + " ..."


def _exotic(session: Any) -> bool:
    return any(v.type in _EXOTIC for v in list(session.get_inputs()) + list(session.get_outputs()))


def _to_ortvalue(ort: Any, array: np.ndarray, type_str: str) -> Any:
    if type_str in _EXOTIC:
        _, onnx_type, storage = _EXOTIC[type_str]
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(array).view(storage), onnx_type)
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))


def _from_ortvalue(value: Any, type_str: str) -> np.ndarray:
    if type_str in _EXOTIC:
        import ml_dtypes

        name, _, storage = _EXOTIC[type_str]
        raw = ctypes.string_at(value.data_ptr(), value.tensor_size_in_bytes())
        return np.frombuffer(raw, dtype=storage).view(getattr(ml_dtypes, name)).reshape(value.shape())
    return value.numpy()


def run(session: Any, feeds: Mapping[str, np.ndarray], output_names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Run ``session`` on ``feeds``; return the outputs by name, in the model's output order.

    Raises:
        ModelError: ONNX Runtime failed while running (bad feed shape, out-of-range index, ...).
    """
    names = output_names or [o.name for o in session.get_outputs()]
    try:
        if not _exotic(session):
            values = session.run(names, dict(feeds))
            return dict(zip(names, values))
        ort = import_ort()
        in_types = {i.name: i.type for i in session.get_inputs()}
        out_types = {o.name: o.type for o in session.get_outputs()}
        ort_feeds = {k: _to_ortvalue(ort, np.asarray(v), in_types.get(k, "")) for k, v in feeds.items()}
        values = session.run_with_ort_values(names, ort_feeds)
        return {n: _from_ortvalue(v, out_types[n]) for n, v in zip(names, values)}
    except (ModelError, BackendUnavailableError):
        raise
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own unrelated exception types
        raise ModelError(f"ONNX Runtime failed running the model: {_short(exc)}") from exc


class OrtBackend(Backend):
    """ONNX Runtime on CPU (or any execution provider the installed build has)."""

    name = "ort"
    target = "ort"
    description = "ONNX Runtime (CPU by default; other execution providers when installed)"
    extra = "ort"
    module = "onnxruntime"

    def make_runner(
        self,
        model: Any,
        *,
        optimizations: bool = True,
        threads: int | None = None,
        providers: list[str] | None = None,
    ) -> Runner:
        """A runner of ``model`` in an ONNX Runtime session.

        Its first act is the ``lower`` step for target ``ort`` where the model still holds fused custom ops
        (on a copy: the caller's model is not changed), so ONNX Runtime runs its own kernels, not the
        ops' function bodies; ``runner.lowered`` holds what that did.
        """
        from mograph.lowering import lowered_for

        model, lowered = lowered_for(model, "ort")
        session = make_session(model, optimizations=optimizations, threads=threads, providers=providers)
        names = [o.name for o in session.get_outputs()]

        def runner(feeds: Mapping[str, Any]) -> dict[str, Any]:
            return run(session, feeds, names)

        runner.session = session  # type: ignore[attr-defined]
        runner.lowered = lowered  # type: ignore[attr-defined]
        return runner


BACKEND = OrtBackend()
