"""The IR version of every model mograph writes or runs: what its opsets need, never newer than the runtime reads.

Why: ``onnx.helper.make_model`` stamps the newest IR version the installed ``onnx`` knows (14 with onnx
1.23), and an ONNX Runtime built against an older ``onnx`` refuses such a file outright ("Unsupported model
IR version: 14, max supported IR version: 13", onnxruntime-gpu 1.31.1), even though nothing in it needs
IR 14.  So every model mograph creates (probe models, one-node models, the models passes build) and every
model it saves goes through :func:`fit_ir_version`:

    ir_version = max(needed by the opsets, min(the model's own, the newest the installed runtime reads))

*Needed by the opsets* is ``onnx.helper.find_min_ir_version_for``; *the newest the runtime reads* is asked
of the installed ``onnxruntime`` itself (:func:`runtime_max_ir_version`: a one-node model at each IR
version, newest first, until one loads; measured once per process), never taken from a hand-written table.
Without onnxruntime nothing caps the version.  A model is never lowered below what its opsets need.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

if TYPE_CHECKING:
    import onnx

__all__ = ["fit_ir_version", "make_model", "needed_ir_version", "runtime_max_ir_version"]

logger = logging.getLogger(__name__)

#: The oldest IR version probed (ONNX 1.2); a runtime that reads none of them gives no cap.
_OLDEST_PROBED = 3
#: IR versions every ONNX Runtime the README supports reads (1.31.1 reads up to 13): a model at or below
#: this needs no probe, so loading and saving such a model does not import onnxruntime.
_ALWAYS_READ = 10


@functools.lru_cache(maxsize=1)
def runtime_max_ir_version() -> int | None:
    """The newest model IR version the installed ONNX Runtime loads, or ``None`` without onnxruntime.

    Measured: a one-node ``Identity`` model (opset 7) at each IR version from ``onnx.IR_VERSION`` down,
    until a session accepts it.
    """
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "ir_probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    for version in range(int(onnx.IR_VERSION), _OLDEST_PROBED - 1, -1):
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 7)], ir_version=version)
        try:
            ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - ORT's own exception types; any refusal means "not this version"
            continue
        if version < onnx.IR_VERSION:
            logger.debug("onnxruntime %s reads IR versions up to %d (onnx knows %d)", ort.__version__, version,
                         onnx.IR_VERSION)
        return version
    return None


def needed_ir_version(opset_imports: Mapping[str, int]) -> int:
    """The smallest IR version that allows these opset imports (``{domain: version}``)."""
    from onnx import helper

    opsets = [helper.make_opsetid(d, int(v)) for d, v in opset_imports.items()]
    return int(helper.find_min_ir_version_for(opsets, ignore_unknown=True))


def _fitted(current: int | None, opset_imports: Mapping[str, int]) -> int:
    need = needed_ir_version(opset_imports)
    version = current if current else need
    if version > _ALWAYS_READ:
        cap = runtime_max_ir_version()
        if cap is not None:
            version = min(version, cap)
    return max(version, need)


def fit_ir_version(model: ir.Model | onnx.ModelProto) -> int:
    """Set ``model``'s IR version by the rule in the module docstring (in place); return it.

    Accepts an ``onnx_ir`` model or an ``onnx.ModelProto``.
    """
    if isinstance(model, ir.Model):
        model.ir_version = _fitted(model.ir_version, dict(model.opset_imports))
        return int(model.ir_version)
    opsets = {o.domain: int(o.version) for o in model.opset_import}
    model.ir_version = _fitted(int(model.ir_version) or None, opsets)
    return int(model.ir_version)


def make_model(graph: onnx.GraphProto, opset_imports: Mapping[str, int], **kwargs: Any) -> onnx.ModelProto:
    """``onnx.helper.make_model`` with an IR version the installed runtime reads (module docstring).

    An ``ir_version=`` given is taken as the model's own (capped and raised like any other).
    """
    from onnx import helper

    asked = kwargs.pop("ir_version", 0)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, int(v)) for d, v in opset_imports.items()],
                              **kwargs)
    proto.ir_version = int(asked)
    fit_ir_version(proto)
    return proto
