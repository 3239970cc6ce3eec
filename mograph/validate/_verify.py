"""The verifier: one model's outputs on fixed feeds, checked against rewritten or lowered versions of it.

Part of :mod:`mograph.validate`, which re-exports the public names.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from mograph import _spill, ir_io
from mograph._traverse import iter_nodes
from mograph.backend_protocol import Runner
from mograph.errors import ModelError, MographError, UsageError
from mograph.validate._compare import _fmt, _polygraphy, compare_outputs
from mograph.validate._feeds import graph_inputs, keep_decoder_assumptions, make_feeds
from mograph.validate._tolerances import Tolerance, _families, dtype_class, tolerance_for

if TYPE_CHECKING:
    from mograph.custom_ops import Declarations

__all__ = ["Verifier", "diff_models"]

logger = logging.getLogger("mograph.validate")

#: Of an output's largest magnitude times the tolerance's ``rtol``: the least ``atol`` of the element-wise bound
#: (float32 exact passes: 1e-4 of the peak; an output peaking at 1 or less keeps the table's 1e-4).
PEAK_FRACTION = 0.1


#: The original is kept for the second-shape check only when its weights are at most this big.
SECOND_SHAPE_COPY_LIMIT = 256 * 2**20


def _static_dims(dims: Mapping[str, list[int | None]]) -> bool:
    return any(isinstance(d, int) for v in dims.values() for d in v)


def _weight_bytes(model: ir.Model) -> int:
    total = 0
    for v in model.graph.initializers.values():
        t = v.const_value
        total += int(getattr(t, "nbytes", 0) or 0) if t is not None else 0
    return total


def _feeds_brief(info: Mapping[str, Any]) -> str:
    return ", ".join(f"{n} {'x'.join(map(str, i['shape'])) or 'scalar'}" for n, i in info.items())


_NP_OF_ORT = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
}


def _fp8_cache_scales(model: Any) -> dict[str, np.ndarray]:
    """FP8 KV-cache tensor name -> scale, from the model's ``mograph.kv_cache`` metadata (stored mode only)."""
    from mograph.metadata import kv_cache_scales, read_kv_cache

    if not isinstance(model, ir.Model) and not hasattr(model, "metadata_props"):
        return {}
    if read_kv_cache(model).get("io") != "fp8":
        return {}
    return kv_cache_scales(model)


def _to_fp8(arr: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``arr / scale`` saturated to FP8 E4M3 (what ``QuantizeLinear`` with ``saturate=1`` gives)."""
    import ml_dtypes

    return np.clip(np.asarray(arr, np.float32) / scale, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)


def _run(runner: Runner, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Outputs of a backend runner as numpy arrays; a runner's own failure becomes a ModelError."""
    try:
        outputs = runner(dict(feeds))
    except MographError:  # a missing runtime or a bad model says so itself
        raise
    except Exception as exc:  # noqa: BLE001 - a runtime's own exception types
        raise ModelError(f"{type(exc).__name__}: {exc}") from exc
    return {str(k): np.asarray(v) for k, v in dict(outputs).items()}


def _input_names(model: Any) -> list[str] | None:
    """The names of the inputs ``model`` takes, or ``None`` when it is not a model mograph reads."""
    if model is None:
        return None
    if isinstance(model, (str, os.PathLike)) and not os.fspath(model).endswith(".onnx"):
        return None
    try:
        loaded = model if isinstance(model, ir.Model) else ir_io.load_model(model, check=False)
    except MographError:
        return None
    return [str(v.name) for v in graph_inputs(loaded)]


def _session_inputs(runner: Any) -> list[str] | None:
    """The inputs an ONNX Runtime runner's session takes (its graph inputs that are not initializers), or
    ``None`` for another runner: a model file need not be read again (decoded, for a model whose weights
    are inside its file, beside the session that holds them) to learn them."""
    session = getattr(runner, "session", None)
    get_inputs = getattr(session, "get_inputs", None)
    if not callable(get_inputs):
        return None
    try:
        return [str(i.name) for i in get_inputs()]
    except Exception:  # noqa: BLE001 - any runtime's session-like object: read the file instead
        return None


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
        feed_limit: bound on the random feeds in bytes (default :data:`~mograph.validate.FEED_LIMIT_BYTES`).
        reference_runner: compute the original's outputs with this backend runner instead of ONNX
            Runtime with its optimizations off (``mograph diff --backend NAME``).
        device: where ONNX Runtime runs both sides: ``None``/``"cpu"`` (default) or ``"cuda"``/``"cuda:N"``
            (the CUDA provider, TF32 off, the CPU for the nodes CUDA has no kernel for; exit code 7
            without onnxruntime-gpu), so a pass is checked on the kernels it will run on.
        reference_label: what ``reference_runner`` is, for the report (``check["backend"]``).
        assumptions: optimize flags whose graphs assume a decoder's inputs are right-padded and its
            ``position_ids`` cache positions (``--mask-format lengths``, ``--kv-cache shared``, ``--position-ids
            cache``; :func:`~mograph.validate._feeds.decoder_assumptions`): the random feeds keep them (masks
            all ones, ``position_ids`` = past + s), so an exact rewrite is not failed on inputs it documents it
            does not take.
        registry: what the plugins declared (the composition root's registry): a candidate's TensorRT
            plugin nodes are checked through the function bodies of the ops declaring them; without it
            they are reported unchecked.
        dims: sizes of named dims in every input (``{"batch": 2}``: fix-shapes' ``--dim``), as ``shapes``
            sizes whole inputs; a model pinned that way is checked at the sizes it was pinned to.

    Raises:
        UsageError: bad shapes or feeds, or feeds past ``feed_limit``.
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
        feed_limit: int | None = None,
        reference_runner: Runner | None = None,
        reference_label: str | None = None,
        device: str | None = None,
        registry: Declarations | None = None,
        assumptions: Iterable[str] = (),
        dims: Mapping[str, int] | None = None,
    ) -> None:
        from mograph.backends import ort

        self.registry = registry
        kind, _ = ort.parse_device(device)
        self.device = None if kind == "cpu" else device
        if self.device is not None:
            ort.require_device(self.device)  # exit 7 before any work

        _polygraphy()  # fail early, before any pass runs, when polygraphy is missing
        self.seed = int(seed)
        self.atol, self.rtol, self.min_cosine = atol, rtol, min_cosine
        self.threads = threads
        model = original if isinstance(original, ir.Model) else ir_io.load_model(original, check=False)
        self.feeds, self.feed_info = make_feeds(
            model, shapes=shapes, feeds=feeds, seed=self.seed, limit_bytes=feed_limit, named_dims=dims
        )
        #: The optimize flags whose graphs assume right padding / cache positions (``decoder_assumptions``): the
        #: random feeds keep them, and the report says so.
        self.assumptions = list(assumptions)
        keep_decoder_assumptions(self.feeds, self.feed_info, self.assumptions)
        self.feed_limit = feed_limit
        #: Whether the original quantizes activations while it runs: a last-bit change before the quantizer
        #: (a fused op's other rounding) can move a value by one quantization step (said with a failure).
        self.runtime_quantized = _quantizes_activations(model)
        #: Per output, the max abs change when every activation quantizer's input moves by one of its steps
        #: (:meth:`_one_step_spread`); the hint above goes only with failures no larger (empty: not measured).
        self.one_step: dict[str, float] = {}
        #: Outputs the original computes in float16/bfloat16 and casts to a wider float at the end (onnxconverter-
        #: common's ``keep_io_types``, mograph's own fp16 with float32 I/O): judged at the precision they were computed
        #: in, as an output a pass made float16 is (two correct runs differ by float16 rounding, not float32's).
        self.computed_in = _computed_in_half(model)
        #: Each input's dims in the original (an int where static), to find axes a shape pass made dynamic.
        self.input_dims = {
            str(v.name): [d if isinstance(d, int) else None for d in (v.shape.dims if v.shape is not None else ())]
            for v in graph_inputs(model)
        }
        # The original is usually rewritten in place afterwards: a small one with static input dims is kept,
        # so a model whose axes became dynamic can be checked at a second size too (see _second_shape).
        # (an original given as a file is that file: read again if a second shape is checked, not copied here,
        # where its weights, decoded when they are inside the file, would sit beside every session made next)
        self._original_copy: ir.Model | str | None = None
        if reference_runner is None and _static_dims(self.input_dims) and _weight_bytes(model) <= SECOND_SHAPE_COPY_LIMIT:
            self._original_copy = (os.fspath(original) if isinstance(original, (str, os.PathLike))
                                   else ir_io.copy_model(model))
        if model is not original:
            # loaded here to read its inputs: collected now (an IR graph is a web of cycles), its weights do not
            # sit beside the session of the original made next
            del model
            _spill.free_dropped()
        if reference_runner is not None:
            try:
                self.reference = _run(reference_runner, self.feeds)
            except ModelError as exc:
                raise ModelError(
                    f"the original model fails on the verification feeds ({_feeds_brief(self.feed_info['inputs'])}) "
                    f"on {reference_label or 'the reference backend'}: {exc}"
                ) from exc
            self.output_names = list(self.reference)
            self.backend = reference_label or "the reference backend"
            logger.info("verification feeds: %s (seed %d)", _feeds_brief(self.feed_info["inputs"]), self.seed)
            return
        try:
            session = ort.make_session(original, optimizations=False, threads=threads, device=self.device,
                                       memory_arena=False)
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
        where = "CPU" if self.device is None else f"{self.device.upper()}, TF32 off"
        self.backend = f"onnxruntime {ort.ort_version()} ({where}, graph optimizations off)"
        del session
        if self.runtime_quantized:
            self.one_step = self._one_step_spread(original)
        _spill.trim_heap()  # its buffers back to the system before the passes run
        logger.info("verification feeds: %s (seed %d)", _feeds_brief(self.feed_info["inputs"]), self.seed)

    def tolerances(self, family: str | Iterable[str] | None) -> dict[str, Tolerance]:
        out = {
            name: tolerance_for(arr.dtype, family, atol=self.atol, rtol=self.rtol, min_cosine=self.min_cosine)
            for name, arr in self.reference.items()
        }
        for name, dtype in getattr(self, "computed_in", {}).items():
            if name in out:
                out[name] = out[name].loosest(
                    tolerance_for(dtype, family, atol=self.atol, rtol=self.rtol, min_cosine=self.min_cosine))
        return out

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
            "assumptions": list(self.assumptions),
        }

    def _fail(self, check: dict[str, Any], reason: str) -> dict[str, Any]:
        check.update(passed=False, reason=reason, summary=f"FAILED: {reason}")
        logger.info("verification: %s", check["summary"])
        return check

    def check(
        self,
        model: Any,
        family: str | Iterable[str] | None = None,
        *,
        runner: Runner | None = None,
        label: str | None = None,
    ) -> dict[str, Any]:
        """Run ``model`` on the feeds and compare with the original's outputs.

        Args:
            model: the rewritten model (same forms as the original).
            family: the family of the pass(es) that produced it, or a set of families; selects the
                tolerances (loosest applicable).  ``None``: tight tolerances.
            runner: run the model through this backend runner (``backend.make_runner(model)``)
                instead of ONNX Runtime with its optimizations off; ``model`` then only says which
                inputs it takes (``None``, or a form mograph cannot read, such as an engine file: all
                the feeds).
            label: what ``runner`` is, for the report (``check["candidate"]``).

        Returns:
            A JSON-serialisable dict: ``passed``, ``summary`` (one line), ``reason`` (set when the
            model could not be compared at all), ``outputs`` (per output: ``max_abs``,
            ``max_rel``, ``cosine``, ``passed``, ``atol``, ``rtol``, ``min_cosine`` and
            ``failures``), ``feeds`` (what was fed), ``defaulted_dims``, ``seed``, ``family``.
        """
        check = self._base(family)
        if runner is not None:
            check["candidate"] = label or "the backend under test"
            outputs = self._run_candidate(check, model, runner)
        else:
            model = self._through_function_bodies(check, model)
            outputs = self._run_ort(check, model)
        if outputs is None:
            return check
        self.judge(check, outputs, family)
        if runner is None and check["passed"]:
            self._second_shape(check, model, family)
        if check.get("plugin_nodes"):
            check["summary"] += (f"; {check['plugin_nodes']} TensorRT plugin node(s) checked through their "
                                 "ops' function bodies (ONNX Runtime has no kernel for them)")
        return check

    def _second_shape(self, check: dict[str, Any], model: Any, family: str | Iterable[str] | None) -> None:
        """Check ``model`` again at a second size of each axis it made dynamic (static in the original).

        An axis at position 0 of every input that carries it (a batch axis) gets twice the old size, and is
        compared with the original run on each half, the halves' outputs concatenated (items along axis 0
        taken as independent, as a batch is).  Another axis (a sequence) gets a smaller size: the original,
        static, cannot run there, so the model is checked to run and to give finite outputs of the ranks the
        original gives, and the report says it was not compared.  ``check["shapes_checked"]`` lists what ran.
        """
        from mograph.backends import ort

        if not isinstance(model, ir.Model):
            return
        check.setdefault("shapes_checked", [{"feeds": _feeds_brief(check["feeds"]), "compared": True}])
        axes: dict[str, list[tuple[str, int, int]]] = {}
        for v in graph_inputs(model):
            old = self.input_dims.get(str(v.name))
            dims = v.shape.dims if v.shape is not None else ()
            for ax, d in enumerate(dims):
                was = old[ax] if old and ax < len(old) else None
                if not isinstance(d, int) and isinstance(was, int):
                    axes.setdefault(str(d), []).append((str(v.name), ax, was))
        for sym, places in axes.items():
            old_size = places[0][2]
            batch = all(ax == 0 for _, ax, _ in places) and self._original_copy is not None
            size = 2 * old_size if batch else (old_size // 2 if old_size > 1 else 2)
            shapes = {n: list(a.shape) for n, a in self.feeds.items()}
            for name, ax, _ in places:
                shapes[name][ax] = size
            try:
                feeds, info = make_feeds(model, shapes=shapes, seed=self.seed + 1, limit_bytes=self.feed_limit)
                keep_decoder_assumptions(feeds, info, self.assumptions)
                session = ort.make_session(model, optimizations=False, threads=self.threads, device=self.device,
                                           memory_arena=False)
                names = [o.name for o in session.get_outputs()]
                outputs = ort.run(session, {i.name: feeds[i.name] for i in session.get_inputs()}, names)
            except MographError as exc:
                self._fail(check, f"at the second shape of dynamic axis '{sym}' ({size}): {exc}")
                return
            entry: dict[str, Any] = {"axis": sym, "size": size, "feeds": _feeds_brief(info["inputs"])}
            check["shapes_checked"].append(entry)
            if batch:
                first = {n: (a[:old_size] if any(n == p[0] for p in places) else a) for n, a in feeds.items()}
                second = {n: (a[old_size:] if any(n == p[0] for p in places) else a) for n, a in feeds.items()}
                ref_session = ort.make_session(self._original_copy, optimizations=False, threads=self.threads,
                                               device=self.device, memory_arena=False)
                try:
                    parts = [ort.run(ref_session, f, self.output_names) for f in (first, second)]
                except ModelError as exc:
                    entry.update(compared=False, why=f"the original does not run on the halves: {exc}")
                    continue
                if not all(parts[0][n].ndim and parts[0][n].shape[0] == old_size for n in self.output_names):
                    entry.update(compared=False, why="not every output has the batch axis first")
                    continue
                reference = {n: np.concatenate([parts[0][n], parts[1][n]]) for n in self.output_names}
                sub = self._base(family)
                saved = self.reference
                try:
                    self.reference = reference
                    # the original ran at the old batch size and the model at twice it: ONNX Runtime's
                    # kernels round otherwise there (mediapipe's pose landmark model: 0.047 on an output
                    # reaching 1330, for two identical halves), so an error small beside the output's largest
                    # magnitude passes; a batch mixed up is off by the values themselves
                    self.judge(sub, outputs, family, peak_scaled=True)
                finally:
                    self.reference = saved
                entry.update(compared=True, passed=sub["passed"], summary=sub["summary"])
                if not sub["passed"]:
                    detail = "; ".join(
                        f"output '{n}': " + "; ".join(e.get("failures", []))
                        for n, e in sub["outputs"].items() if not e["passed"]
                    )
                    self._fail(check, f"at the second shape of dynamic axis '{sym}' ({entry['feeds']}), "
                                      f"against the original on each half: {detail}")
                    return
            else:
                bad = [n for n in names if n in self.reference and (
                    outputs[n].ndim != self.reference[n].ndim
                    or (outputs[n].dtype.kind == "f" and not np.all(np.isfinite(outputs[n]))))]
                entry.update(compared=False, passed=not bad,
                             why="the original is static on this axis: checked that it runs, output ranks, finite")
                if bad:
                    self._fail(check, f"at the second shape of dynamic axis '{sym}' ({entry['feeds']}): output(s) "
                                      f"{bad} have another rank than the original's or non-finite values")
                    return
        check["summary"] += "; also at " + "; ".join(
            f"{e['axis']}={e['size']} ({'compared with the original on each half' if e['compared'] else 'ran, not compared: original static'})"
            for e in check["shapes_checked"][1:]
        ) if len(check["shapes_checked"]) > 1 else ""

    def _through_function_bodies(self, check: dict[str, Any], model: Any) -> Any:
        """A copy of ``model`` whose mograph TensorRT plugin nodes are their canonical ops again, with
        function bodies, so ONNX Runtime can run them (``check["plugin_nodes"]`` counts them); ``model``
        itself when it has none."""
        from mograph.lowering import is_plugin_node, plugin_nodes_as_ops

        if not isinstance(model, ir.Model):
            return model
        if not any(is_plugin_node(n) for n in ir.traversal.RecursiveGraphIterator(model.graph)):
            return model
        copy = ir_io.copy_model(model)
        done, left = plugin_nodes_as_ops(copy, self.registry.custom_ops if self.registry is not None else {})
        check["plugin_nodes"] = done
        if left:
            check["plugin_nodes_unchecked"] = left
            logger.warning("verification: plugin node(s) with no function body to check: %s", "; ".join(left))
        return copy

    def _run_ort(self, check: dict[str, Any], model: Any) -> dict[str, np.ndarray] | None:
        from mograph.backends import ort

        try:
            session = ort.make_session(model, optimizations=False, threads=self.threads, device=self.device,
                                       memory_arena=False)
        except ModelError as exc:
            self._fail(check, f"the optimized model cannot be loaded: {exc}")
            return None
        names = [o.name for o in session.get_outputs()]
        if names != self.output_names:
            self._fail(check, self._names_changed(names))
            return None
        feeds: dict[str, np.ndarray] = {}
        notes: list[str] = []
        cache = _fp8_cache_scales(model)
        for inp in session.get_inputs():
            if inp.name not in self.feeds:
                self._fail(check, f"the optimized model has an input '{inp.name}' the original does not have")
                return None
            arr = self.feeds[inp.name]
            want = _NP_OF_ORT.get(inp.type)
            if inp.type == "tensor(float8e4m3fn)" and inp.name in cache and dtype_class(arr.dtype) != "float8":
                notes.append(f"input '{inp.name}' fed as float8e4m3fn with its recorded KV-cache scale")
                arr = _to_fp8(arr, cache[inp.name])
            elif want is not None and arr.dtype != want and dtype_class(arr.dtype) not in ("int", "bool"):
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
            self._fail(check, f"the optimized model fails on the verification feeds: {exc}")
            return None
        del session
        _spill.trim_heap()  # its buffers back to the system before the comparison and the save
        for name, arr in outputs.items():  # an FP8 KV cache is compared by the values it stands for
            if name in cache and dtype_class(arr.dtype) == "float8":
                outputs[name] = arr.astype(np.float32) * cache[name]
        return outputs

    def _run_candidate(self, check: dict[str, Any], model: Any, runner: Runner) -> dict[str, np.ndarray] | None:
        feeds = dict(self.feeds)
        inputs = _session_inputs(runner) if isinstance(model, (str, os.PathLike)) else None
        if inputs is None:
            inputs = _input_names(model)
        if inputs is not None:
            extra = [n for n in inputs if n not in self.feeds]
            if extra:
                self._fail(check, f"the model under test has an input '{extra[0]}' the original does not have")
                return None
            feeds = {n: self.feeds[n] for n in inputs}
            dropped = sorted(set(self.feeds) - set(feeds))
            if dropped:
                check["notes"] = [f"the model under test does not take input(s) {dropped}"]
        try:
            outputs = _run(runner, feeds)
        except ModelError as exc:
            self._fail(check, f"{check['candidate']} fails on the verification feeds: {exc}")
            return None
        if set(outputs) != set(self.output_names):
            self._fail(check, self._names_changed(list(outputs)))
            return None
        return {n: outputs[n] for n in self.output_names}

    def _names_changed(self, names: list[str]) -> str:
        if len(names) != len(self.output_names):
            what = f"output count changed from {len(self.output_names)} to {len(names)}"
        elif set(names) == set(self.output_names):
            what = "output order changed"
        else:
            what = "output names changed"
        return f"{what}: original {self.output_names}, optimized {names}"

    def judge(
        self, check: dict[str, Any], outputs: Mapping[str, np.ndarray], family: str | Iterable[str] | None,
        *, peak_scaled: bool = False,
    ) -> dict[str, Any]:
        """Fill ``check`` (from :meth:`check`) with the verdict on ``outputs`` (named as the original's).

        A float output's ``atol`` is at least :data:`PEAK_FRACTION` x ``rtol`` times the reference's largest
        magnitude unless the verifier was given an ``atol``; ``peak_scaled``: at least ``rtol`` times it (the two
        runs are at different batch sizes, where ONNX Runtime's kernels round otherwise).
        """
        tolerances = self.tolerances(family)
        for name, arr in outputs.items():
            ref_dtype = self.reference[name].dtype
            if arr.dtype != ref_dtype and dtype_class(arr.dtype) not in ("int", "bool", "other"):
                # e.g. a precision pass made a float32 output float16: judge it at the lower precision
                tolerances[name] = tolerances[name].loosest(
                    tolerance_for(arr.dtype, family, atol=self.atol, rtol=self.rtol, min_cosine=self.min_cosine)
                )
        # The absolute floor of the element-wise bound follows the output's scale: a reordered float sum is
        # off by rounding relative to the magnitudes summed, not to each element, so an exact rewrite of a deep
        # model with large values (a real Gemma 3 270M: logits 3.8e-4 off at fixed atol 1e-4) failed on the
        # elements near zero. The floor is PEAK_FRACTION of rtol times the largest magnitude (rtol itself for
        # the second-shape run); a --atol the user gives is taken as given.
        fraction = 1.0 if peak_scaled else (PEAK_FRACTION if self.atol is None else 0.0)
        if fraction:
            for name, tol in tolerances.items():
                ref = self.reference.get(name)
                if tol.atol is None or not tol.rtol or ref is None or ref.dtype.kind != "f" or not ref.size:
                    continue
                finite = np.abs(ref[np.isfinite(ref)].astype(np.float64))
                peak = float(finite.max()) if finite.size else 0.0
                if fraction * tol.rtol * peak > tol.atol:
                    tolerances[name] = replace(tol, atol=fraction * tol.rtol * peak)
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
        head += f" on {_feeds_brief(check.get('feeds') or {})}"
        if self.assumptions:  # the random masks / position_ids were made to keep the documented assumptions
            verb = "assumes" if len(self.assumptions) == 1 else "assume"
            head += f" (masks all ones, position_ids past + s, as {', '.join(self.assumptions)} {verb})"
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
        hint = ""
        if parts and getattr(self, "runtime_quantized", False) and self._within_one_step(check):
            hint = (" (the original quantizes activations while it runs (DynamicQuantizeLinear / QuantizeLinear): "
                    "a last-bit change before a quantizer, as a fused op rounds differently, moves a value by a "
                    "whole quantization step, and this difference is no larger than one step of every quantizer "
                    f"moves the output ({self._spread_text(check)}); judge it on the task's metric, or with "
                    "`mograph diff` at a looser --atol)")
        return ("; ".join(parts) or "no output failed") + fam_s + hint + where

    def _within_one_step(self, check: Mapping[str, Any]) -> bool:
        """Whether every failed output's max abs error is at most the change one quantization step makes there
        (:attr:`one_step`): a larger one is not the quantizer's rounding of a last-bit change."""
        spread = getattr(self, "one_step", {})
        failed = {n: e for n, e in check.get("outputs", {}).items() if not e["passed"]}
        return bool(failed) and all(
            n in spread and e.get("max_abs") is not None and float(e["max_abs"]) <= spread[n] for n, e in failed.items()
        )

    def _spread_text(self, check: Mapping[str, Any]) -> str:
        return ", ".join(f"'{n}' up to {_fmt(self.one_step[n])}" for n, e in check.get("outputs", {}).items()
                         if not e["passed"] and n in self.one_step)

    def _one_step_spread(self, original: Any) -> dict[str, float]:
        """Per output, the max abs change of the reference when the input of every activation quantizer moves
        by one step of that quantizer, up or down at random (seeded), on the verification feeds.

        A last-bit change before a quantizer moves each quantized element by at most one step, and only the
        elements next to a rounding boundary, so a difference it causes is at most about this one, where every
        element of every quantizer moves (a one-element flip is smaller by roughly the square root of the
        elements a value sums).  The step is the quantizer's own scale: a ``QuantizeLinear``'s scale input (a
        per-tensor one; per-axis quantizers are left as they are) and the scale a ``DynamicQuantizeLinear``
        computes from the same input.  Measured in ONNX Runtime on a copy of the original: only for
        originals of at most :data:`SECOND_SHAPE_COPY_LIMIT` of weights, where this costs one more run
        (empty otherwise, and when the probe cannot run: the hint is then not given).
        """
        from mograph.backends import ort

        try:
            model = original if isinstance(original, ir.Model) else ir_io.load_model(original, check=False)
            if _weight_bytes(model) > SECOND_SHAPE_COPY_LIMIT:
                return {}
            probe = ir_io.copy_model(model)
            del model
            if not _nudge_quantizer_inputs(probe, self.seed):
                return {}
            session = ort.make_session(probe, optimizations=False, threads=self.threads, device=self.device,
                                       memory_arena=False)
            got = ort.run(session, self.feeds, self.output_names)
        except (MographError, ValueError, TypeError, RuntimeError) as exc:
            logger.debug("one-step probe of the quantizers not measured: %s", exc)
            return {}
        spread: dict[str, float] = {}
        for name, ref in self.reference.items():
            arr = got.get(name)
            if arr is None or arr.shape != ref.shape or dtype_class(ref.dtype) not in ("float64", "float32", "float16", "bfloat16") or not ref.size:
                continue
            spread[name] = float(np.max(np.abs(arr.astype(np.float64) - ref.astype(np.float64))))
        logger.info("one quantization step moves the outputs by up to %s", {n: _fmt(v) for n, v in spread.items()})
        return spread


def _activation_quantizers(graph: ir.Graph) -> list[ir.Node]:
    """The nodes of ``graph`` (not its subgraphs) that quantize an activation, as :func:`_quantizes_activations`."""
    found = []
    for node in graph:
        if node.domain not in ("", "ai.onnx") or not node.inputs or node.inputs[0] is None:
            continue
        x = node.inputs[0]
        made = x.producer()
        if node.op_type == "DynamicQuantizeLinear" or (
                node.op_type == "QuantizeLinear" and x.const_value is None and (made is None or made.op_type != "Constant")):
            found.append(node)
    return found


def _nudge_quantizer_inputs(model: ir.Model, seed: int) -> int:
    """Move the input of each activation quantizer of ``model``'s main graph by one of its steps, its sign
    random per element (``RandomUniformLike``, seeded): ``x + scale * sign(u)``.  Returns how many moved."""
    moved = 0
    for i, node in enumerate(_activation_quantizers(model.graph)):
        x = node.inputs[0]
        assert x is not None
        extra: list[ir.Node] = []
        if node.op_type == "DynamicQuantizeLinear":
            twin = ir.node("DynamicQuantizeLinear", [x], num_outputs=3)
            extra.append(twin)
            scale = twin.outputs[1]
        else:
            scale_v = node.inputs[1] if len(node.inputs) > 1 else None
            if scale_v is None or scale_v.shape is None or scale_v.shape.rank() != 0:
                continue  # per-axis or blocked scales: left as they are
            scale = scale_v
        noise = ir.node("RandomUniformLike", [x], attributes={"low": -1.0, "high": 1.0, "seed": float(seed * 1000 + i + 1)})
        sign = ir.node("Sign", [noise.outputs[0]])
        step = ir.node("Mul", [sign.outputs[0], scale])
        moved_x = ir.node("Add", [x, step.outputs[0]])
        extra += [noise, sign, step, moved_x]
        model.graph.insert_before(node, extra)
        node.replace_input_with(0, moved_x.outputs[0])
        moved += 1
    return moved


def _computed_in_half(model: ir.Model) -> dict[str, Any]:
    """Graph outputs written by a ``Cast`` to float32/float64 from a float16/bfloat16 tensor: name -> numpy dtype
    of the tensor cast (the precision the output was computed in)."""
    wide = (ir.DataType.FLOAT, ir.DataType.DOUBLE)
    half = {ir.DataType.FLOAT16: np.float16}
    try:
        import ml_dtypes

        half[ir.DataType.BFLOAT16] = ml_dtypes.bfloat16
    except ImportError:  # pragma: no cover - ml_dtypes comes with onnx
        pass
    out: dict[str, Any] = {}
    for value in model.graph.outputs:
        node = value.producer()
        if node is None or node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        src = node.inputs[0]
        to = node.attributes.get("to")
        if src is None or to is None or to.is_ref() or ir.DataType(to.value) not in wide:
            continue
        if src.dtype in half:
            out[str(value.name)] = half[src.dtype]
    return out


def _quantizes_activations(model: ir.Model) -> bool:
    """Whether ``model`` has a ``DynamicQuantizeLinear`` (any graph) or a ``QuantizeLinear`` whose input is
    not a constant: its outputs move by whole quantization steps when a value before it moves by one ulp."""
    for node in iter_nodes(model.graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "DynamicQuantizeLinear":
            return True
        if node.op_type == "QuantizeLinear" and node.inputs and node.inputs[0] is not None:
            x = node.inputs[0]
            made = x.producer()
            if x.const_value is None and (made is None or made.op_type != "Constant"):
                return True
    return False


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
    backend: Any = None,
    device: str | None = None,
    feed_limit: int | None = None,
    registry: Declarations | None = None,
) -> dict[str, Any]:
    """Compare model ``b`` against model ``a`` (the reference) on the same feeds.

    ``backend``: run both models on this backend (a registered name or a backend object), its own
    graph optimizations off; ``None`` or ``"ort"``: ONNX Runtime, as :class:`Verifier` does.
    ``device``: where the backend runs both (``"cuda"``: see :class:`Verifier`); a backend without
    ``devices`` takes none.  ``feed_limit``: bound on the random feeds in bytes (see :class:`Verifier`).
    ``registry``: the registry of the job (the composition root's), which gives the backends by name and
    the custom ops a backend lowers; a backend named by a string needs it.

    Returns the check dict of :meth:`Verifier.check` (``passed``, ``summary``, ``outputs`` ...);
    does not raise when the numbers differ: the caller decides (``mograph diff`` exits 5).
    """
    if isinstance(b, (str, os.PathLike)):
        ir_io.load_model(b, check=False)  # a missing or unreadable B is a ModelError, not a difference
    options = dict(
        shapes=shapes, feeds=feeds, seed=seed, atol=atol, rtol=rtol, min_cosine=min_cosine, threads=threads,
        feed_limit=feed_limit,
    )
    if isinstance(backend, str):
        from mograph.backend_protocol import get_backend

        if registry is None:
            raise UsageError(f"diff_models(backend={backend!r}): a backend named by a string needs registry=")
        backend = get_backend(registry.backends, backend, job="diff")
    if backend is None or getattr(backend, "name", None) == "ort":
        verifier = Verifier(a, device=device, registry=registry, **options)  # type: ignore[arg-type]
        check = verifier.check(b, family=family)
    else:
        from mograph.backend_protocol import check_device, registry_keywords, require_available

        extra = check_device(backend, device)
        extra.update(registry_keywords(backend.make_runner, registry))
        require_available(backend)
        label = f"backend '{backend.name}' (its graph optimizations off)"
        ref_runner = backend.make_runner(a, optimizations=False, threads=threads, **extra)
        verifier = Verifier(a, reference_runner=ref_runner, reference_label=label, registry=registry,
                            **options)  # type: ignore[arg-type]
        runner = backend.make_runner(b, optimizations=False, threads=threads, **extra)
        check = verifier.check(b, family=family, runner=runner, label=label)
    if not check["passed"]:
        check["failure"] = verifier.describe_failure(check)
    check["tolerances"] = {n: asdict(t) for n, t in verifier.tolerances(family).items()}
    return check
