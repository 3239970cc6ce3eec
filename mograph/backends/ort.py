"""The ONNX Runtime backend (``ort``): sessions for validation and benchmarking.

onnxruntime is imported lazily, the first time a session is made; when it is missing,
:class:`~mograph.errors.BackendUnavailableError` names the pip extra (``mograph[ort]``).

Two uses, two settings of ONNX Runtime's own graph optimizations:

* **validation** (:mod:`mograph.validate`) runs with them **off** (``ORT_DISABLE_ALL``): ONNX
  Runtime's fusions could otherwise rewrite both the original and a broken optimized model into the
  same fused kernels and hide the breakage;
* **benchmarking** (``mograph bench``) runs with them **on** (``ORT_ENABLE_ALL``), which is what a
  deployment runs, unless asked otherwise.

Models reach ONNX Runtime as bytes when they fit in one protobuf (external data of initializers read
from their folder); a model whose in-memory tensors reach protobuf's limit, or one with external tensors
ONNX Runtime could not find from bytes (attributes, several folders), is spilled with external data into
a temporary folder that lives as long as the session (:mod:`mograph._spill`), and loaded from the path.  External data goes through
:mod:`mograph.ir_io`'s checks first, whatever form the model has: never read from outside the model's
folder, nor from the current directory (bytes and protos have no folder: ``base_dir=`` names one).

Types numpy does not have (bfloat16, float8) travel as ``ml_dtypes`` arrays: they are passed to and
read back from ONNX Runtime through ``OrtValue`` s, which ``InferenceSession.run`` cannot do itself.

**Devices** (``device="cpu"`` or ``"cuda"`` / ``"cuda:N"``; the CLI's ``--device``).  On CUDA:

* the CUDA provider must be in ``onnxruntime.get_available_providers()`` (the ``onnxruntime-gpu``
  wheel), else :class:`~mograph.backends.NotAvailableError` (exit code 7) says to install it;
* the CUDA libraries are loaded first (:func:`load_cuda_libraries`: ``onnxruntime.preload_dlls()``,
  and ``import torch`` when that left cuBLAS/cuDNN unloaded and torch is installed, since torch ships
  them), and a session whose CUDA provider still did not start is an exit-7 error, not a silent CPU run;
* the session is ``CUDAExecutionProvider`` then ``CPUExecutionProvider`` (ONNX Runtime puts the nodes
  CUDA has no kernel for on the CPU and inserts ``Memcpy`` nodes); the runner's first run is
  profiled to say which nodes ran where (:attr:`OrtRunner.placement`);
* numeric checks (``optimizations=False``) turn TF32 off (``use_tf32=0``), so float32 MatMuls are
  float32; runs as deployed keep ONNX Runtime's default (TF32 on);
* :meth:`OrtRunner.bind` gives benchmarks device-resident feeds and outputs (IO binding), and
  ``cuda_graph=True`` captures the whole run as one CUDA graph (``enable_cuda_graph``): ONNX Runtime
  allows that only when every compute node runs on CUDA, and the graph is fixed to the shapes of its
  first feeds (symbolic dims are pinned to them with ``add_free_dimension_override_by_name``, so the
  shape computations fold away).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import io
import logging
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnx_ir as ir

from mograph.backends import Backend, NotAvailableError
from mograph.errors import BackendUnavailableError, ModelError, UsageError

if TYPE_CHECKING:
    from mograph.custom_ops import Declarations

__all__ = [
    "OrtBackend",
    "OrtRunner",
    "BACKEND",
    "CUDA_PROVIDER",
    "DEVICES",
    "CudaGraphRefused",
    "import_ort",
    "make_session",
    "run",
    "ort_version",
    "needs_file",
    "parse_device",
    "require_device",
    "load_cuda_libraries",
    "profile_placement",
    "probe_outputs",
]

logger = logging.getLogger(__name__)

#: ONNX Runtime type strings numpy lacks -> (ml_dtypes name, ONNX TensorProto type, storage dtype).
_EXOTIC = {
    "tensor(bfloat16)": ("bfloat16", onnx.TensorProto.BFLOAT16, np.uint16),
    "tensor(float8e4m3fn)": ("float8_e4m3fn", onnx.TensorProto.FLOAT8E4M3FN, np.uint8),
    "tensor(float8e5m2)": ("float8_e5m2", onnx.TensorProto.FLOAT8E5M2, np.uint8),
}


#: The execution provider of ``device="cuda"``.
CUDA_PROVIDER = "CUDAExecutionProvider"
#: The device kinds :meth:`OrtBackend.make_runner` takes (``cuda:N`` picks a GPU).
DEVICES = ("cpu", "cuda")

#: ONNX Runtime type strings -> numpy dtypes (for output buffers of CUDA graphs).
_NP_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
}


class CudaGraphRefused(UsageError):
    """ONNX Runtime refused ``cuda_graph=True`` for this model (nodes outside CUDA, control flow, dynamic
    shapes); the message is its reason.  ``mograph bench`` adds the nodes that run on the CPU."""


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
    """Whether ``model`` must reach ONNX Runtime as a file: its in-memory tensors reach the protobuf limit
    (:func:`mograph._spill.proto_limit`), or it has external tensors ONNX Runtime could not find from bytes
    (in several folders, or in tensor attributes: as bytes, they would be read from the current directory)."""
    from mograph import _spill, ir_io

    if _spill.too_big(model):
        return True
    external = ir_io.external_tensors(model)
    in_initializers = [v.const_value for v in _initializer_values(model) if isinstance(v.const_value, ir.ExternalTensor)]
    return len(external) != len(in_initializers) or len({str(t.base_dir) for t in external}) > 1


def _external_folder(model: ir.Model) -> str | None:
    return next((str(t.base_dir) for v in _initializer_values(model)
                 if isinstance((t := v.const_value), ir.ExternalTensor) and t.base_dir), None)


def _model_payload(model: Any, base_dir: str | os.PathLike | None = None) -> Any:
    """What ``InferenceSession`` gets (a :class:`mograph._spill.Payload`): a path, or bytes with the folder
    their external data is read from; a model too big for one protobuf is spilled to a temporary folder
    (:func:`mograph._spill.spill`) that lives as long as the session.

    External data goes through the checks of :mod:`mograph.ir_io` whatever form the model has: a
    path's is read from its own folder only; bytes and a ``ModelProto`` have no folder, so theirs is
    refused unless ``base_dir`` names one (given to ONNX Runtime as bytes, it would be read from the
    current directory); an ``onnx_ir.Model``'s tensors must each have a folder, and stay inside it.
    """
    from mograph import _spill, ir_io

    if base_dir is not None and not isinstance(model, (bytes, bytearray, onnx.ModelProto)):
        raise UsageError(
            "base_dir applies to a model given as bytes or an onnx.ModelProto (a path reads its external "
            "data from its own folder, an onnx_ir.Model's tensors from theirs)"
        )
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.is_file():
            raise ModelError(f"{path}: no such file")
        ir_io.check_model_file(path)  # external data outside the model's folder: ModelError
        return _spill.Payload(path=str(path))
    if isinstance(model, (bytes, bytearray, onnx.ModelProto)):
        loaded = ir_io.load_model(model, check=False, base_dir=base_dir)  # no folder: external data refused
        if not ir_io.external_tensors(loaded):
            if isinstance(model, (bytes, bytearray)):
                return _spill.Payload(data=bytes(model))
            if not _spill.too_big(model):
                return _spill.Payload(data=model.SerializeToString())
        model = loaded  # external data read from base_dir; too big: spilled with the model
    if isinstance(model, ir.Model):
        ir_io.check_external_data(model)
        _spill.drop_pages(model)  # weights a pass read: not resident twice once ONNX Runtime loads its copy
        if needs_file(model):
            spilled = _spill.spill(model)
            return _spill.Payload(path=spilled.path, spilled=spilled)
        return _spill.Payload(data=ir.serde.serialize_model(model).SerializeToString(),
                              folder=_external_folder(model))
    raise UsageError(f"cannot run a model given as {type(model).__name__}: give a path, bytes, ModelProto or ir.Model")


def parse_device(device: str | None) -> tuple[str, int]:
    """``None``/``"cpu"`` -> ``("cpu", 0)``; ``"cuda"`` -> ``("cuda", 0)``; ``"cuda:1"`` -> ``("cuda", 1)``.

    Raises:
        UsageError: anything else.
    """
    if device is None:
        return "cpu", 0
    text = str(device).strip().lower()
    kind, sep, index = text.partition(":")
    if kind not in DEVICES or (sep and (kind == "cpu" or not index.isdigit())):
        raise UsageError(f"unknown device {device!r}: use cpu, cuda or cuda:N")
    return kind, int(index) if index else 0


def require_device(device: str | None) -> None:
    """Raise :class:`~mograph.backends.NotAvailableError` (exit code 7) when ``device`` cannot run here:
    onnxruntime missing, or ``cuda`` asked of a build without the CUDA provider."""
    kind, _ = parse_device(device)
    ort = import_ort()
    if kind == "cuda":
        available = list(ort.get_available_providers())
        if CUDA_PROVIDER not in available:
            raise NotAvailableError(
                f"--device cuda: this onnxruntime {ort.__version__} has no {CUDA_PROVIDER} (it has "
                f"{', '.join(available) or 'none'}): pip install onnxruntime-gpu in place of onnxruntime, "
                "on a machine with an NVIDIA GPU",
                "ort",
            )


_CUDA_LIBS: list[str] | None = None


def _cuda_libs_loaded() -> bool:
    """Whether cuBLAS and cuDNN are mapped into this process (Linux; ``False`` where it cannot tell)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return "libcublas" in maps and "libcudnn" in maps


def load_cuda_libraries(ort: Any) -> list[str]:
    """Load the CUDA runtime, cuBLAS and cuDNN before the first CUDA session; return what was done.

    ``onnxruntime.preload_dlls()`` when this onnxruntime has it (its messages are logged, not printed);
    then, if cuBLAS/cuDNN are still not loaded and torch is installed, ``import torch`` (torch wheels
    ship those libraries, and a CUDA 13 onnxruntime-gpu finds them once torch loaded them).  Done once
    per process.
    """
    global _CUDA_LIBS
    if _CUDA_LIBS is not None:
        return _CUDA_LIBS
    done: list[str] = []
    preload = getattr(ort, "preload_dlls", None)
    if callable(preload):
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                preload()
            done.append("onnxruntime.preload_dlls()")
        except Exception as exc:  # noqa: BLE001 - best effort; the session check below is what counts
            logger.info("onnxruntime.preload_dlls() failed: %s", exc)
        if buf.getvalue().strip():
            logger.info("onnxruntime.preload_dlls(): %s", buf.getvalue().strip())
    if not _cuda_libs_loaded() and "torch" not in sys.modules and importlib.util.find_spec("torch") is not None:
        try:
            import torch  # noqa: F401 - loads the CUDA libraries its wheel ships
        except Exception as exc:  # noqa: BLE001
            logger.info("import torch (for its CUDA libraries) failed: %s", exc)
        else:
            done.append("import torch")
    elif "torch" in sys.modules:
        done.append("torch already imported")
    _CUDA_LIBS = done
    return done


def _cuda_provider(device_id: int, *, cuda_graph: bool, numeric: bool,
                   tf32: bool | None = None) -> tuple[str, dict[str, str]]:
    options = {"device_id": str(device_id)}
    if cuda_graph:
        options["enable_cuda_graph"] = "1"
    if tf32 is None:
        tf32 = not numeric
    if not tf32:
        options["use_tf32"] = "0"
    return CUDA_PROVIDER, options


def make_session(
    model_or_path: Any,
    *,
    optimizations: bool = False,
    threads: int | None = None,
    providers: list[str] | None = None,
    device: str | None = None,
    cuda_graph: bool = False,
    free_dims: Mapping[str, int] | None = None,
    profile_prefix: str | None = None,
    tf32: bool | None = None,
    base_dir: str | os.PathLike | None = None,
    memory_arena: bool = True,
    config: Mapping[str, str] | None = None,
) -> Any:
    """Create an ``onnxruntime.InferenceSession``.

    Args:
        model_or_path: a path to an ``.onnx`` file (its external data is read beside it), bytes,
            an ``onnx.ModelProto`` or an ``onnx_ir.Model``.  External data is checked as
            :func:`mograph.ir_io.load_model` checks it: never read from outside the model's folder,
            nor from the current directory.
        optimizations: ONNX Runtime's own graph optimizations: ``False`` (``ORT_DISABLE_ALL``,
            for numeric checks) or ``True`` (``ORT_ENABLE_ALL``, what deployments run).
        threads: intra-op threads (``None``: ONNX Runtime's default, one per core).
        providers: execution providers in priority order (default: CPU only, so numeric checks do
            not depend on the machine's accelerators); not together with ``device="cuda"``.
        device: ``"cpu"`` (default) or ``"cuda"``/``"cuda:N"``: the CUDA provider first, the CPU
            after it for the nodes CUDA has no kernel for (see the module docstring).
        cuda_graph: capture the run as a CUDA graph (``device="cuda"`` only).
        free_dims: pin symbolic dims by name (``{"batch": 1, "seq": 128}``), so shape computations
            fold away (what a CUDA graph needs).
        profile_prefix: turn ONNX Runtime's profiler on, writing ``<prefix>_<time>.json``.
        tf32: TensorFloat-32 float32 MatMuls on CUDA (``None``: off for numeric checks, ONNX Runtime's
            default, on, otherwise).
        base_dir: the folder the external data of a model given as bytes or a ``ModelProto`` is read
            from (they have none of their own: without it, their external data is refused).
        memory_arena: ONNX Runtime's CPU memory arena (its default, what deployments run).  ``False``
            for a session that checks numbers once: a freed buffer goes back to the system instead of
            staying in the arena, which keeps, among others, the float32 copy of every float16 weight
            that the CPU provider's inserted Casts make on each run (measured: a 64 MiB float16 MatMul
            weight costs 136 MiB more per run with the arena, none without).  The memory pattern stays
            on: without it every intermediate is its own allocation, and the heap of a multi-threaded
            run fragments (measured on a 411 MB decoder's int4 form: 377 MiB resident after a run with
            the pattern, 694 MiB without).  The numbers are the same either way.
        config: ONNX Runtime session config entries (``SessionOptions.add_session_config_entry``), e.g.
            ``{"ep.cuda.fpa_intb_gemm": "1"}``; ONNX Runtime ignores keys it does not know.

    Raises:
        BackendUnavailableError: onnxruntime is not installed; exit code 7 too when ``device="cuda"``
            and this onnxruntime has no CUDA provider, or the provider did not start (libraries).
        UsageError: a requested execution provider is not available, or options that do not go together.
        CudaGraphRefused: ONNX Runtime refused the CUDA graph for this model.
        ModelError: ONNX Runtime refuses the model (the message is ONNX Runtime's), or its external
            data lies outside its folder or has no folder.
    """
    ort = import_ort()
    kind, device_id = parse_device(device)
    if kind == "cpu" and providers and CUDA_PROVIDER in providers:
        kind = "cuda"  # --provider CUDAExecutionProvider means the CUDA device
    if cuda_graph and kind != "cuda":
        raise UsageError("a CUDA graph (--cuda-graph) needs --device cuda")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimizations else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    opts.log_severity_level = 3  # errors only: ONNX Runtime's warnings are not ours to print
    if not memory_arena:
        opts.enable_cpu_mem_arena = False
    if threads is not None:
        if threads < 1:
            raise UsageError(f"threads must be at least 1, not {threads}")
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    for name, value in (free_dims or {}).items():
        opts.add_free_dimension_override_by_name(str(name), int(value))
    for key, entry in (config or {}).items():
        opts.add_session_config_entry(str(key), str(entry))
    if profile_prefix is not None:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    chosen: list[Any]
    if kind == "cuda":
        require_device("cuda")
        if device is not None and providers and providers[0] != CUDA_PROVIDER:
            raise UsageError(f"device {device!r} and providers {providers} disagree; give one of them")
        load_cuda_libraries(ort)
        chosen = [_cuda_provider(device_id, cuda_graph=cuda_graph, numeric=not optimizations, tf32=tf32),
                  "CPUExecutionProvider"]
    else:
        chosen = list(providers or ["CPUExecutionProvider"])
        missing = [p for p in chosen if p not in ort.get_available_providers()]
        if missing:
            raise UsageError(
                f"execution provider(s) {missing} not available in this onnxruntime; "
                f"available: {', '.join(ort.get_available_providers())}"
            )
    payload = _model_payload(model_or_path, base_dir)
    try:
        session = payload.session(opts, chosen)
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own unrelated exception types
        if payload.spilled is not None:
            payload.spilled.cleanup()
        text = _short(exc)
        if cuda_graph and ("graph capture" in text.lower() or "cuda graph" in text.lower()):
            raise CudaGraphRefused(
                f"ONNX Runtime cannot capture this model as a CUDA graph: {text}. A CUDA graph needs every "
                "compute node on CUDA, no control flow and static shapes"
            ) from exc
        raise ModelError(f"ONNX Runtime cannot load the model: {text}") from exc
    if kind == "cuda" and CUDA_PROVIDER not in session.get_providers():
        raise NotAvailableError(
            f"ONNX Runtime's {CUDA_PROVIDER} did not start (the session fell back to "
            f"{', '.join(session.get_providers())}): its CUDA runtime, cuBLAS or cuDNN libraries were not "
            f"found (tried: {', '.join(load_cuda_libraries(ort)) or 'nothing'}); install the NVIDIA libraries "
            "onnxruntime-gpu needs (pip install 'onnxruntime-gpu[cuda,cudnn]', or torch with the same CUDA major)",
            "ort",
        )
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


def _free_dims(model: Any, shapes: Mapping[str, Any]) -> dict[str, int]:
    """Symbolic dim name -> size, read off the model's graph inputs and the feeds' ``shapes``."""
    if isinstance(model, ir.Model):
        inputs = [(str(v.name), [d if isinstance(d, int) else getattr(d, "value", None) for d in (v.shape or [])])
                  for v in model.graph.inputs]
    else:
        if isinstance(model, (str, os.PathLike)):
            proto = onnx.load(os.fspath(model), load_external_data=False)
        elif isinstance(model, (bytes, bytearray)):
            proto = onnx.load_model_from_string(bytes(model))
        else:
            proto = model
        inputs = [
            (i.name, [d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else None)
                      for d in i.type.tensor_type.shape.dim])
            for i in proto.graph.input
        ]
    out: dict[str, int] = {}
    for name, dims in inputs:
        shape = shapes.get(name)
        if shape is None:
            continue
        for axis, dim in enumerate(dims):
            if isinstance(dim, str) and dim and axis < len(shape):
                out.setdefault(dim, int(shape[axis]))
    return out


def profile_placement(session: Any, path: str, device_provider: str) -> dict[str, Any]:
    """Stop ``session``'s profiler (started with ``profile_prefix``), read where each node ran from the
    profile at ``path``'s folder and delete the file: see :func:`mograph.backends._ort_profile.placement`."""
    from mograph.backends import _ort_profile

    written = session.end_profiling()
    try:
        return _ort_profile.placement(_ort_profile.read_events(written), device_provider)
    finally:
        with contextlib.suppress(OSError):
            os.remove(written)
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _zero_feeds(session: Any, shapes: Mapping[str, Any]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for inp in session.get_inputs():
        if inp.name not in shapes:
            raise UsageError(f"a CUDA graph needs the shape of every input; '{inp.name}' has none")
        if inp.type not in _NP_TYPES:
            raise UsageError(f"a CUDA graph needs numpy-typed inputs; '{inp.name}' is {inp.type}")
        out[inp.name] = np.zeros(tuple(int(d) for d in shapes[inp.name]), dtype=_NP_TYPES[inp.type])
    return out


def probe_outputs(session: Any, feeds: Mapping[str, np.ndarray], device: str = "cpu") -> dict[str, tuple[tuple[int, ...], Any]]:
    """Run ``session`` once on ``feeds`` (outputs bound on ``device``); return each output's shape and
    numpy dtype, which the output buffers of a CUDA graph need before its first (capturing) run."""
    runner = OrtRunner(session, device=device)
    runner.bind(feeds)()
    specs = {}
    for name, value in zip(runner.names, runner._binding.get_outputs()):
        if value.data_type() not in _NP_TYPES:
            raise UsageError(f"a CUDA graph needs numpy-typed outputs; '{name}' is {value.data_type()}")
        specs[name] = (tuple(value.shape()), _NP_TYPES[value.data_type()])
    return specs


class OrtRunner:
    """An ONNX Runtime session as a backend runner: ``runner(feeds) -> outputs`` (numpy, on the host).

    Attributes:
        session: the ``InferenceSession``.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        cuda_graph: whether runs replay a captured CUDA graph.
        lowered: stats of the ``lower`` step done first (empty when nothing was lowered).
        placement: after the first run of a profiled session, where its nodes ran
            (:func:`mograph.backends._ort_profile.placement`); ``None`` before, or when not profiled.
        free_dims: the symbolic dims pinned for a CUDA graph.
    """

    def __init__(
        self,
        session: Any,
        *,
        device: str = "cpu",
        cuda_graph: bool = False,
        lowered: Mapping[str, Any] | None = None,
        profile_dir: str | None = None,
        free_dims: Mapping[str, int] | None = None,
        output_specs: Mapping[str, tuple[tuple[int, ...], Any]] | None = None,
        placement: dict[str, Any] | None = None,
    ) -> None:
        self.session = session
        self.device = device
        self.kind, self.device_id = parse_device(device)
        self.cuda_graph = cuda_graph
        self.lowered = dict(lowered or {})
        self.free_dims = dict(free_dims or {})
        self.placement: dict[str, Any] | None = placement
        self._profile_dir = profile_dir
        self._output_specs = dict(output_specs) if output_specs is not None else None
        self.names = [o.name for o in session.get_outputs()]
        self._in_types = {i.name: i.type for i in session.get_inputs()}
        self._out_types = {o.name: o.type for o in session.get_outputs()}
        self._graph: tuple[Any, dict[str, Any], dict[str, tuple[int, ...]]] | None = None
        self._graph_outputs: list[Any] = []
        self._bound_inputs: list[Any] = []

    # -- placement ------------------------------------------------------------------------------
    @property
    def profiling(self) -> bool:
        """Whether the next run is the profiled one that records :attr:`placement` (slower: keep it untimed)."""
        return self._profile_dir is not None

    def _after_run(self) -> None:
        if self._profile_dir is not None:
            where = CUDA_PROVIDER if self.kind == "cuda" else "CPUExecutionProvider"
            try:
                self.placement = profile_placement(self.session, self._profile_dir, where)
            finally:
                self._profile_dir = None

    # -- plain runs -----------------------------------------------------------------------------
    def __call__(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        if self.cuda_graph:
            step = self.bind(feeds)
            step()
            return self.outputs()
        out = run(self.session, feeds, self.names)
        self._after_run()
        return out

    # -- IO binding -------------------------------------------------------------------------------
    @property
    def _where(self) -> tuple[str, int]:
        return ("cuda", self.device_id) if self.kind == "cuda" else ("cpu", 0)

    def _input_value(self, ort: Any, name: str, array: Any) -> Any:
        arr = np.ascontiguousarray(array)
        type_str = self._in_types.get(name, "")
        if type_str in _EXOTIC:
            return _to_ortvalue(ort, arr, type_str)  # on the host; ONNX Runtime copies it in
        return ort.OrtValue.ortvalue_from_numpy(arr, *self._where)

    def bind(self, feeds: Mapping[str, Any]) -> Any:
        """IO binding: copy ``feeds`` to the device once and return ``step()``, one run on them that waits
        for the device to finish; the outputs stay on the device (:meth:`outputs` copies them to the host).

        With a CUDA graph, output buffers of the shapes the runner was made with (``output_specs``,
        found by a probe run: a graph writes to fixed addresses) are bound before the first run, in which
        ONNX Runtime captures the graph; later calls copy new feeds into the same input buffers, so they
        must have the shapes the graph was captured for.

        Raises:
            UsageError: a CUDA graph fed other shapes than it was captured for.
            ModelError: ONNX Runtime failed running the model.
        """
        ort = import_ort()
        try:
            if self.cuda_graph:
                return self._bind_graph(ort, feeds)
            binding = self.session.io_binding()
            # CPU OrtValues share the numpy buffers: both stay referenced as long as the binding is used
            self._bound_inputs = [(array, self._input_value(ort, name, array)) for name, array in feeds.items()]
            for name, (_, value) in zip(feeds, self._bound_inputs):
                binding.bind_ortvalue_input(name, value)
            for name in self.names:
                if self._out_types[name] in _EXOTIC:
                    binding.bind_output(name, "cpu")
                else:
                    binding.bind_output(name, *self._where)
            binding.synchronize_inputs()
        except (ModelError, UsageError):
            raise
        except Exception as exc:  # noqa: BLE001 - onnxruntime's own exception types
            raise ModelError(f"ONNX Runtime cannot bind the feeds: {_short(exc)}") from exc
        self._binding = binding
        return self._stepper(binding)

    def _stepper(self, binding: Any) -> Any:
        session = self.session

        def step() -> None:
            try:
                session.run_with_iobinding(binding)
                binding.synchronize_outputs()
            except Exception as exc:  # noqa: BLE001
                raise ModelError(f"ONNX Runtime failed running the model: {_short(exc)}") from exc
            self._after_run()

        return step

    def _bind_graph(self, ort: Any, feeds: Mapping[str, Any]) -> Any:
        shapes = {n: tuple(np.shape(a)) for n, a in feeds.items()}
        if self._graph is not None:
            binding, inputs, captured = self._graph
            if shapes != captured:
                raise UsageError(f"the CUDA graph was captured for feeds {captured}; these are {shapes}")
            for name, array in feeds.items():
                inputs[name].update_inplace(np.ascontiguousarray(array))
            binding.synchronize_inputs()
            self._binding = binding
            return self._stepper(binding)
        if any(t in _EXOTIC for t in [*self._in_types.values(), *self._out_types.values()]):
            raise UsageError("a CUDA graph needs numpy-typed inputs and outputs (no bfloat16/float8)")
        if self._output_specs is None:
            raise UsageError("a CUDA graph runner needs its output shapes (make it with make_runner(..., shapes=...))")
        binding = self.session.io_binding()
        inputs = {name: self._input_value(ort, name, array) for name, array in feeds.items()}
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        self._graph_outputs = []  # the buffers the graph writes to: kept alive as long as the runner
        for name in self.names:
            shape, dtype = self._output_specs[name]
            buffer = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, *self._where)
            self._graph_outputs.append(buffer)
            binding.bind_ortvalue_output(name, buffer)
        binding.synchronize_inputs()
        self._graph = (binding, inputs, shapes)
        self._binding = binding
        return self._stepper(binding)

    def outputs(self) -> dict[str, Any]:
        """The outputs of the last :meth:`bind` step, copied to the host as numpy arrays."""
        binding = self._binding
        if any(self._out_types[n] in _EXOTIC for n in self.names):
            values = binding.get_outputs()
            return {n: _from_ortvalue(v, self._out_types[n]) for n, v in zip(self.names, values)}
        return dict(zip(self.names, binding.copy_outputs_to_cpu()))


class OrtBackend(Backend):
    """ONNX Runtime on CPU or CUDA (or any execution provider the installed build has)."""

    name = "ort"
    target = "ort"
    description = "ONNX Runtime (CPU by default; --device cuda with onnxruntime-gpu; other providers when installed)"
    extra = "ort"
    module = "onnxruntime"
    devices = DEVICES

    def make_runner(
        self,
        model: Any,
        *,
        optimizations: bool = True,
        threads: int | None = None,
        providers: list[str] | None = None,
        device: str | None = None,
        cuda_graph: bool = False,
        shapes: Mapping[str, Any] | None = None,
        placement: bool | None = None,
        tf32: bool | None = None,
        registry: Declarations | None = None,
        session_config: Mapping[str, str] | None = None,
    ) -> OrtRunner:
        """A runner of ``model`` in an ONNX Runtime session (:class:`OrtRunner`).

        Its first act is the ``lower`` step for target ``ort`` where the model still holds fused custom ops
        (on a copy: the caller's model is not changed), so ONNX Runtime runs its own kernels, not the
        ops' function bodies; ``runner.lowered`` holds what that did.

        Args:
            device: ``cpu`` (default) or ``cuda``/``cuda:N`` (exit code 7 without the CUDA provider).
            cuda_graph: replay the run as a CUDA graph; ``shapes`` (the feeds' shapes by input name)
                then pin the model's symbolic dims, which a graph needs.
            placement: profile the first run to record where each node ran (``runner.placement``);
                default: on for CUDA (nodes can fall back to the CPU there), off on the CPU.  Not with
                a CUDA graph (ONNX Runtime refuses graphs with nodes outside CUDA anyway).
            tf32: TensorFloat-32 float32 MatMuls on CUDA (``None``: ONNX Runtime's default, on, with
                optimizations; off without).
            registry: the job's registry, whose custom ops are lowered for ``ort`` first; without it
                nothing is lowered (custom ops run as their function bodies).
            session_config: ONNX Runtime session config entries for the session(s) (:func:`make_session`).
        """
        from mograph.lowering import lowered_for

        kind, _ = parse_device(device)
        if kind == "cpu" and providers and CUDA_PROVIDER in providers:
            kind, device = "cuda", "cuda"
        if kind == "cuda":
            require_device(device)  # exit 7 before any work
        lowered: dict[str, int | float] = {}
        if registry is not None:
            model, lowered = lowered_for(model, "ort", registry=registry)
        if cuda_graph:
            return self._graph_runner(model, lowered, optimizations, threads, device or "cuda", shapes, tf32,
                                      session_config)
        if placement is None:
            placement = kind == "cuda"
        profile_dir = tempfile.mkdtemp(prefix="mograph-ort-profile-") if placement else None
        try:
            session = make_session(
                model,
                optimizations=optimizations,
                threads=threads,
                providers=None if kind == "cuda" else providers,
                device=device if kind == "cuda" else None,
                profile_prefix=os.path.join(profile_dir, "ort") if profile_dir else None,
                tf32=tf32 if kind == "cuda" else None,
                config=session_config,
            )
        except BaseException:
            if profile_dir is not None:
                with contextlib.suppress(OSError):
                    os.rmdir(profile_dir)
            raise
        return OrtRunner(session, device=device or "cpu", lowered=lowered, profile_dir=profile_dir)

    @staticmethod
    def _graph_runner(
        model: Any, lowered: Mapping[str, Any], optimizations: bool, threads: int | None, device: str,
        shapes: Mapping[str, Any] | None, tf32: bool | None = None, session_config: Mapping[str, str] | None = None,
    ) -> OrtRunner:
        """A CUDA-graph runner: a probe session without the graph first (zero feeds of ``shapes``), for
        the output shapes the graph's buffers need and for where the nodes run, then the graph session;
        a refusal names the nodes that run on the CPU."""
        if not shapes:
            raise UsageError("a CUDA graph needs the feeds' shapes (make_runner(..., shapes={input: dims}))")
        free = _free_dims(model, shapes)
        folder = tempfile.mkdtemp(prefix="mograph-ort-profile-")
        probe = make_session(model, optimizations=optimizations, threads=threads, device=device, free_dims=free,
                             profile_prefix=os.path.join(folder, "ort"), tf32=tf32, config=session_config)
        specs = probe_outputs(probe, _zero_feeds(probe, shapes), device)
        where = profile_placement(probe, folder, CUDA_PROVIDER)
        del probe
        try:
            session = make_session(model, optimizations=optimizations, threads=threads, device=device,
                                   cuda_graph=True, free_dims=free, tf32=tf32, config=session_config)
        except CudaGraphRefused as exc:
            off = where["fallback"]
            names = ", ".join(f"{e['name']} ({e['op_type']}, {e['provider']})" for e in off[:8])
            more = f", ... {len(off) - 8} more" if len(off) > 8 else ""
            detail = (f"; with dims pinned to {free or 'the model'}, {len(off)} node(s) still run outside CUDA: "
                      f"{names}{more}" if off else "")
            raise CudaGraphRefused(f"{exc}{detail}. Drop --cuda-graph, or pin the shapes first "
                                   "(mograph optimize --passes fix-shapes --shape ...)") from exc
        return OrtRunner(session, device=device, cuda_graph=True, lowered=lowered, free_dims=free,
                         output_specs=specs, placement=where)


BACKEND = OrtBackend()
