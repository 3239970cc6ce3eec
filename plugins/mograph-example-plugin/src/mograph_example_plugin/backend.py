"""The backend ``example-ref``: models run by ``onnx.reference.ReferenceEvaluator`` (pure numpy, slow, exact).

A template for a third-party backend, following the protocol documented in
:func:`mograph.hookspecs.mograph_add_backends` (it subclasses :class:`mograph.backends.Backend`, which
supplies the optional members' defaults).  It works in every job that takes ``--backend``:
``mograph bench``, ``mograph validate``, ``mograph diff`` and, since it has a ``build()``,
``mograph build`` (the artifact is the lowered ``.onnx`` model it would run).

Before running a model it lowers it for its ``target`` (``onnx``) through mograph's ``lower`` step
(``mograph.lowering.lower_model``), which asks each custom op of the registry — the built-in
``mograph.*`` ones and plugins' such as ``example.BetaSwish`` — for its ``onnx`` lowering.  Custom-op nodes
that stay (no lowering, or one that declined) run as their numpy ``reference`` from the registry, the
way a runtime runs a native kernel, instead of their function body.

The registry whose custom ops it lowers and runs is the one the job hands it (the ``registry`` keyword
of ``make_runner`` and ``build``, which mograph's jobs give a backend that takes it), or the one it was
made with; like mograph's own library code it never looks the registry up itself.

It needs nothing beyond ``onnx``; ``optimizations``, ``threads`` and ``providers`` mean nothing to it.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

import mograph
from mograph.backends import Backend, Runner

__all__ = ["ReferenceBackend", "BACKEND"]

_STANDARD = ("", "ai.onnx", "ai.onnx.ml")


def _lower(model: ir.Model, target: str, registry: Any) -> dict[str, Any]:
    """Lower ``model`` in place for ``target`` with mograph's ``lower`` step; its stats."""
    from mograph.lowering import lower_model

    result = lower_model(model, target, registry=registry)
    return {"lowered": True, "stats": dict(result.stats)}


def _kernel(op: mograph.CustomOp) -> type:
    """An ``onnx.reference`` op class that runs ``op``'s numpy reference."""
    from onnx.reference.op_run import OpRun

    def _run(self: Any, *inputs: Any, **attributes: Any) -> tuple[Any, ...]:
        outputs = op.reference(*inputs, **attributes)  # type: ignore[misc]
        return tuple(np.asarray(o) for o in outputs)

    return type(op.name, (OpRun,), {"op_domain": op.domain, "_run": _run})


class ReferenceBackend(Backend):
    """onnx.reference.ReferenceEvaluator; custom ops left after lowering run as their numpy references."""

    name = "example-ref"
    description = "onnx.reference.ReferenceEvaluator (numpy; slow, exact); custom ops run their numpy references"
    extra = ""
    target = "onnx"
    module = "onnx"
    artifact_suffix = ".ref.onnx"

    def __init__(self, registry: Any = None) -> None:
        #: The registry whose custom ops it lowers and runs when a job gives none.
        self._registry = registry

    def _registry_for(self, given: Any) -> Any:
        registry = given if given is not None else self._registry
        if registry is None:
            raise mograph.UsageError(f"backend '{self.name}' needs the registry (registry=) to lower and run custom ops")
        return registry

    def why_unavailable(self) -> str:
        return "the onnx package is not installed: pip install onnx"

    def prepare(self, model: Any, registry: Any) -> tuple[onnx.ModelProto, dict[str, Any]]:
        """A lowered copy of ``model`` (the caller's model is never changed) and what lowering did.

        The copy holds every tensor in memory: ``onnx.reference`` would resolve external data against
        the current directory, so it is read here, from the model's own folder, by ``mograph.save``
        (which checks it as ``mograph.load`` does) into a self-contained file loaded back.
        """
        loaded = mograph.load(model)
        with tempfile.TemporaryDirectory(prefix="mograph-example-ref-") as tmp:
            path = os.path.join(tmp, "model.onnx")
            mograph.save(loaded, path, external_data=False)
            copy = mograph.load(path)
        info = _lower(copy, self.target or self.name, registry)
        return ir.serde.serialize_model(copy), info

    def make_runner(
        self,
        model: Any,
        *,
        optimizations: bool = True,
        threads: int | None = None,
        providers: list[str] | None = None,
        registry: Any = None,
        **options: Any,
    ) -> Runner:
        from onnx.reference import ReferenceEvaluator

        registry = self._registry_for(registry)
        proto, info = self.prepare(model, registry)
        kernels = []
        for domain, op_type in sorted({(n.domain, n.op_type) for n in proto.graph.node if n.domain not in _STANDARD}):
            op = registry.custom_ops.get((domain, op_type))
            if op is not None and op.reference is not None:
                kernels.append(_kernel(op))
                kept = [f for f in proto.functions if (f.domain, f.name) != (domain, op_type)]
                del proto.functions[:]
                proto.functions.extend(kept)
        try:
            evaluator = ReferenceEvaluator(proto, new_ops=kernels or None)
        except Exception as exc:  # noqa: BLE001 - onnx.reference raises many types on models it cannot run
            raise mograph.ModelError(f"onnx.reference cannot load the model: {type(exc).__name__}: {exc}") from exc
        names = [o.name for o in proto.graph.output]

        def run(feeds: Mapping[str, Any]) -> dict[str, Any]:
            try:
                values = evaluator.run(None, dict(feeds))
            except Exception as exc:  # noqa: BLE001
                raise mograph.ModelError(f"onnx.reference failed running the model: {type(exc).__name__}: {exc}") from exc
            return dict(zip(names, values))

        run.model = proto  # type: ignore[attr-defined]
        run.lowering = info  # type: ignore[attr-defined]
        run.kernels = [k.__name__ for k in kernels]  # type: ignore[attr-defined]
        return run

    def build(self, model: Any, path: str | os.PathLike[str], *, registry: Any = None, **options: Any) -> dict[str, Any]:
        """Write the lowered model this backend would run to ``path`` (atomically); a short report."""
        if options:
            raise mograph.UsageError(f"backend '{self.name}' takes no build options, got: {', '.join(sorted(options))}")
        proto, info = self.prepare(model, self._registry_for(registry))
        dest = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent or ".")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(proto.SerializeToString())
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        ops = Counter(f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in proto.graph.node)
        return {"artifact_bytes": dest.stat().st_size, "nodes": len(proto.graph.node), "op_types": dict(ops), **info}


BACKEND = ReferenceBackend()
