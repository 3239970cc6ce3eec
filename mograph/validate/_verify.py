"""The verifier: one model's outputs on fixed feeds, checked against rewritten or lowered versions of it.

Part of :mod:`mograph.validate`, which re-exports the public names.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any

import numpy as np
import onnx_ir as ir

from mograph import ir_io
from mograph.errors import ModelError
from mograph.validate._compare import _fmt, _polygraphy, compare_outputs
from mograph.validate._feeds import make_feeds
from mograph.validate._tolerances import Tolerance, _families, dtype_class, tolerance_for

__all__ = ["Verifier", "diff_models"]

logger = logging.getLogger("mograph.validate")


def _feeds_brief(info: Mapping[str, Any]) -> str:
    return ", ".join(f"{n} {'x'.join(map(str, i['shape'])) or 'scalar'}" for n, i in info.items())


_NP_OF_ORT = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
}


class Verifier:
    """Checks rewritten versions of one model against it, on fixed feeds.

    The feeds and the original's outputs are computed at construction: the model given is usually
    rewritten in place by the passes that follow, so it is run right away.

    Args:
        original: the model as it is now (``onnx_ir.Model``, path, bytes or ``onnx.ModelProto``).
        shapes: sizes of dynamic dims by input name, ``{"input_ids": (1, 128)}``.
        feeds: the user's feeds: ``.npz`` path (keys are input names) or a dict of arrays; inputs
            it lacks get random feeds.
        seed: seed of the random feeds.
        atol, rtol, min_cosine: override the tolerance table for floating outputs.
        threads: ONNX Runtime intra-op threads (default: ONNX Runtime's choice).

    Raises:
        UsageError: bad shapes or feeds.
        ModelError: ONNX Runtime cannot load or run the original model.
        BackendUnavailableError: onnxruntime or polygraphy is missing.
    """

    def __init__(
        self,
        original: Any,
        *,
        shapes: Mapping[str, Iterable[int]] | None = None,
        feeds: str | os.PathLike | Mapping[str, Any] | None = None,
        seed: int = 0,
        atol: float | None = None,
        rtol: float | None = None,
        min_cosine: float | None = None,
        threads: int | None = None,
    ) -> None:
        from mograph.backends import ort

        _polygraphy()  # fail early, before any pass runs, when polygraphy is missing
        self.seed = int(seed)
        self.atol, self.rtol, self.min_cosine = atol, rtol, min_cosine
        self.threads = threads
        model = original if isinstance(original, ir.Model) else ir_io.load_model(original, check=False)
        self.feeds, self.feed_info = make_feeds(model, shapes=shapes, feeds=feeds, seed=self.seed)
        try:
            session = ort.make_session(original, optimizations=False, threads=threads)
        except ModelError as exc:
            raise ModelError(f"cannot run the original model for verification: {exc}") from exc
        self.output_names = [o.name for o in session.get_outputs()]
        try:
            self.reference = ort.run(session, self.feeds, self.output_names)
        except ModelError as exc:
            raise ModelError(
                f"the original model fails on the verification feeds ({_feeds_brief(self.feed_info['inputs'])}): "
                f"{exc}; give realistic inputs with --feeds or sizes with --shape"
            ) from exc
        self.backend = f"onnxruntime {ort.ort_version()} (CPU, graph optimizations off)"
        del session
        logger.info("verification feeds: %s (seed %d)", _feeds_brief(self.feed_info["inputs"]), self.seed)

    def tolerances(self, family: str | Iterable[str] | None) -> dict[str, Tolerance]:
        return {
            name: tolerance_for(arr.dtype, family, atol=self.atol, rtol=self.rtol, min_cosine=self.min_cosine)
            for name, arr in self.reference.items()
        }

    def _base(self, family: str | Iterable[str] | None) -> dict[str, Any]:
        return {
            "passed": False,
            "summary": "",
            "reason": None,
            "family": _families(family),
            "outputs": {},
            "feeds": self.feed_info["inputs"],
            "defaulted_dims": self.feed_info["defaulted_dims"],
            "seed": self.seed,
            "backend": self.backend,
        }

    def _fail(self, check: dict[str, Any], reason: str) -> dict[str, Any]:
        check.update(passed=False, reason=reason, summary=f"FAILED: {reason}")
        logger.info("verification: %s", check["summary"])
        return check

    def check(self, model: Any, family: str | Iterable[str] | None = None) -> dict[str, Any]:
        """Run ``model`` on the feeds and compare with the original's outputs.

        Args:
            model: the rewritten model (same forms as the original).
            family: the family of the pass(es) that produced it, or a set of families; selects the
                tolerances (loosest applicable).  ``None``: tight tolerances.

        Returns:
            A JSON-serialisable dict: ``passed``, ``summary`` (one line), ``reason`` (set when the
            model could not be compared at all), ``outputs`` (per output: ``max_abs``,
            ``max_rel``, ``cosine``, ``passed``, ``atol``, ``rtol``, ``min_cosine`` and
            ``failures``), ``feeds`` (what was fed), ``defaulted_dims``, ``seed``, ``family``.
        """
        from mograph.backends import ort

        check = self._base(family)
        try:
            session = ort.make_session(model, optimizations=False, threads=self.threads)
        except ModelError as exc:
            return self._fail(check, f"the optimized model cannot be loaded: {exc}")
        names = [o.name for o in session.get_outputs()]
        if names != self.output_names:
            if len(names) != len(self.output_names):
                what = f"output count changed from {len(self.output_names)} to {len(names)}"
            elif set(names) == set(self.output_names):
                what = "output order changed"
            else:
                what = "output names changed"
            return self._fail(check, f"{what}: original {self.output_names}, optimized {names}")
        feeds: dict[str, np.ndarray] = {}
        notes: list[str] = []
        for inp in session.get_inputs():
            if inp.name not in self.feeds:
                return self._fail(check, f"the optimized model has an input '{inp.name}' the original does not have")
            arr = self.feeds[inp.name]
            want = _NP_OF_ORT.get(inp.type)
            if want is not None and arr.dtype != want and dtype_class(arr.dtype) not in ("int", "bool"):
                notes.append(f"input '{inp.name}' fed as {np.dtype(want)} (the optimized model's type)")
                arr = arr.astype(want)
            feeds[inp.name] = arr
        dropped = sorted(set(self.feeds) - set(feeds))
        if dropped:
            notes.append(f"the optimized model no longer takes input(s) {dropped}")
        if notes:
            check["notes"] = notes
        try:
            outputs = ort.run(session, feeds, names)
        except ModelError as exc:
            return self._fail(check, f"the optimized model fails on the verification feeds: {exc}")
        tolerances = self.tolerances(family)
        for name, arr in outputs.items():
            ref_dtype = self.reference[name].dtype
            if arr.dtype != ref_dtype and dtype_class(arr.dtype) not in ("int", "bool", "other"):
                # e.g. a precision pass made a float32 output float16: judge it at the lower precision
                tolerances[name] = tolerances[name].loosest(
                    tolerance_for(arr.dtype, family, atol=self.atol, rtol=self.rtol, min_cosine=self.min_cosine)
                )
        entries = compare_outputs(self.reference, outputs, tolerances)
        check["outputs"] = entries
        check["passed"] = all(e["passed"] for e in entries.values())
        check["summary"] = self._summary(check)
        logger.info("verification: %s", check["summary"])
        return check

    @staticmethod
    def _worst(outputs: Mapping[str, dict[str, Any]]) -> str | None:
        if not outputs:
            return None

        def key(item: tuple[str, dict[str, Any]]) -> tuple[Any, ...]:
            _, e = item
            cos = e.get("cosine")
            return (e["passed"], cos if cos is not None else (2.0 if e["passed"] else -2.0), -(e.get("max_abs") or 0.0))

        return min(outputs.items(), key=key)[0]

    def _summary(self, check: Mapping[str, Any]) -> str:
        outputs = check["outputs"]
        worst = self._worst(outputs)
        n_fail = sum(not e["passed"] for e in outputs.values())
        head = f"passed ({len(outputs)} outputs)" if check["passed"] else f"FAILED ({n_fail} of {len(outputs)} outputs)"
        if worst is None:
            return f"{head}: the model has no outputs"
        e = outputs[worst]
        return (
            f"{head}: worst output '{worst}' max abs {_fmt(e['max_abs'])}, max rel {_fmt(e['max_rel'])}, "
            f"cosine {_fmt(e['cosine'], 6)}"
        )

    def describe_failure(self, check: Mapping[str, Any]) -> str:
        """One line saying what failed and on which feeds."""
        where = f" [feeds: {_feeds_brief(check.get('feeds', {}))}; seed {check.get('seed')}]"
        if check.get("reason"):
            return str(check["reason"]) + where
        parts = []
        for name, e in check.get("outputs", {}).items():
            if not e["passed"]:
                parts.append(f"output '{name}' ({e['dtype']}): " + "; ".join(e.get("failures", [])))
        fam = check.get("family") or []
        fam_s = f" (tolerances of {', '.join(fam)})" if fam else ""
        return ("; ".join(parts) or "no output failed") + fam_s + where


def diff_models(
    a: Any,
    b: Any,
    *,
    shapes: Mapping[str, Iterable[int]] | None = None,
    feeds: str | os.PathLike | Mapping[str, Any] | None = None,
    seed: int = 0,
    atol: float | None = None,
    rtol: float | None = None,
    min_cosine: float | None = None,
    family: str | Iterable[str] | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Compare model ``b`` against model ``a`` (the reference) on the same feeds.

    Returns the check dict of :meth:`Verifier.check` (``passed``, ``summary``, ``outputs`` ...);
    does not raise when the numbers differ: the caller decides (``mograph diff`` exits 5).
    """
    if isinstance(b, (str, os.PathLike)):
        ir_io.load_model(b, check=False)  # a missing or unreadable B is a ModelError, not a difference
    verifier = Verifier(a, shapes=shapes, feeds=feeds, seed=seed, atol=atol, rtol=rtol, min_cosine=min_cosine, threads=threads)
    check = verifier.check(b, family=family)
    if not check["passed"]:
        check["failure"] = verifier.describe_failure(check)
    check["tolerances"] = {n: asdict(t) for n, t in verifier.tolerances(family).items()}
    return check
