"""How one configuration is measured: latency, throughput, peak memory, size, accuracy.

The same procedure serves ``mograph sweep`` (every configuration of a sweep, side by side) and
``mograph gate`` (a candidate beside the row it is gated against):

* **latency / throughput** — every model gets a session first; then the timed runs are
  *interleaved*: each round runs every model once on the same timing feed, the order rotating from
  round to round, so a load change on the machine hits every model alike (``mograph sweep`` of a model
  whose weights reach 256 MiB measures one model at a time instead: see :func:`measure`'s
  ``one_at_a_time``).  Latency is reported as
  p50/p90/p99 in milliseconds over the timed runs after warm-up; throughput is timed runs divided by
  their summed time (inferences/s).
* **peak memory** — the peak resident set size of this process (sampled every 2 ms by psutil, as
  ``mograph bench`` does) while the model's session is created and run once, minus the RSS just
  before: the runtime's copy of the weights, its arena and scratch.  Sessions are created one after
  another, so each figure is that model's own increase.  ``None`` when psutil is missing.
* **size** — bytes of the saved model on disk (``.onnx`` plus external data files beside it).
* **accuracy** — each model is run on every sample of a fixed evaluation set; its outputs are compared
  with the unoptimized baseline's on the same samples: per sample, the cosine similarity of all float
  outputs flattened together (``cosine_mean`` / ``cosine_min`` over samples), the largest absolute
  difference over every float output element (``max_abs``), and ``top1_agreement``: the fraction of
  positions where the argmax over the last axis of the first float output equals the baseline's
  (class predictions for a classifier; for an embedding model a coarse check).  A user *task metric*
  (``module:function`` or ``file.py:function``, found from the current folder) is called as
  ``fn(outputs, samples)`` — or with ``reference`` too if it takes that parameter — where ``outputs``
  and ``reference`` are lists (one per sample) of ``{output name: array}``; it returns a number
  (higher is better) or a dict of named numbers.

All models run on the same backend session settings: the configuration's provider, ONNX Runtime graph
optimizations on (as deployed) unless turned off, a fixed number of intra-op threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from mograph._user_code import load_function
from mograph.errors import UsageError

__all__ = [
    "Target",
    "Measured",
    "measure",
    "accuracy",
    "load_samples",
    "random_samples",
    "hash_samples",
    "hash_file",
    "file_size",
    "versions",
    "load_function",
    "names_code",
    "code_hash",
]

Feed = dict[str, np.ndarray]


# --------------------------------------------------------------------------------------------- hashing
def hash_file(path: str | os.PathLike[str]) -> str:
    """sha256 of a model file and of the external data files it names that lie beside it (hex)."""
    h = hashlib.sha256()
    path = Path(path)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    for extra in _external_files(path):
        h.update(extra.name.encode())
        with open(extra, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _external_files(path: Path) -> list[Path]:
    import onnx

    from mograph import _stream_load

    try:
        proto = _stream_load.proto_without_weights(path)  # a large file's weights are not read
    except Exception:  # noqa: BLE001 - not our job to judge the model here; the loader does that
        return []
    names = set()
    for tensor in onnx.external_data_helper._get_all_tensors(proto):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    names.add(entry.value)
    folder, base = path.parent, path.parent.resolve()
    # Only files inside the model's folder, as mograph.ir_io reads them: a location that is absolute,
    # climbs out with '..' or is a link leading out names a file that is not the model's (and is refused
    # when the model is loaded), so it is neither hashed nor counted.
    return [folder / n for n in sorted(names) if n and not os.path.isabs(n)
            and base in (base / n).resolve().parents and (folder / n).is_file()]


def file_size(path: str | os.PathLike[str]) -> int:
    """Bytes on disk of a model and its external data files."""
    path = Path(path)
    return path.stat().st_size + sum(p.stat().st_size for p in _external_files(path))


def hash_samples(samples: Iterable[Mapping[str, np.ndarray]]) -> str:
    """sha256 of a list of feeds: names, dtypes, shapes and bytes, in order (hex)."""
    h = hashlib.sha256()
    n = 0
    for feed in samples:
        n += 1
        for name in sorted(feed):
            a = np.ascontiguousarray(feed[name])
            h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
            h.update(a.tobytes())
        h.update(b"\x00")
    h.update(str(n).encode())
    return h.hexdigest()


def versions() -> dict[str, str]:
    """Versions of what produced a measurement (installed distributions; none is imported)."""
    out = {"python": sys.version.split()[0]}
    for dist in ("mograph", "onnx", "onnx-ir", "onnxscript", "onnxruntime", "onnxruntime-gpu", "tensorrt",
                 "tensorrt-rtx-cu13", "numpy", "polygraphy", "ray"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


# --------------------------------------------------------------------------------------- user functions
def names_code(spec: Any) -> bool:
    """True when a data or metric spec names code (``module:function`` or ``file.py:function``), not a
    file or folder of data: running it imports and runs that code."""
    if not isinstance(spec, str) or ":" not in spec or spec.startswith("random:"):
        return False
    return not Path(spec).exists()


def code_hash(spec: str) -> str | None:
    """sha256 (hex) of the source file of the code ``spec`` names, found without running it: the ``.py`` of
    ``file.py:function``, or the file the import system would load for ``module:function`` (from the
    current folder first, as :func:`load_function` does).  ``None`` when no source file is found."""
    head = spec.rpartition(":")[0]
    path: Path | None = None
    if head.endswith(".py"):
        path = Path(head)
    elif head:
        added = os.getcwd() not in sys.path and "" not in sys.path
        if added:
            sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(head)
            path = Path(found.origin) if found is not None and found.origin else None
        except (ImportError, ValueError):
            path = None
        finally:
            if added and os.getcwd() in sys.path:
                sys.path.remove(os.getcwd())
    if path is None or not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------ data
def _ranks(model: Any) -> dict[str, int | None]:
    from mograph.validate import graph_inputs

    return {str(v.name): (len(v.shape) if v.shape is not None else None) for v in graph_inputs(model)}


def load_samples(spec: str | os.PathLike[str], model: Any, *, what: str = "--eval-data", limit: int = 0) -> list[Feed]:
    """Read an evaluation (or calibration) set: a folder of ``.npz`` files (one sample each), one ``.npz``
    of stacked samples (leading axis = sample; a sample keeps a batch dim of 1 where the input has the
    array's rank), or ``module:function`` / ``file.py:function`` returning an iterable of feeds."""
    ranks = _ranks(model)
    text = os.fspath(spec)
    path = Path(text)
    samples: list[Feed] = []
    if path.is_dir():
        files = sorted(path.glob("*.npz"))
        if not files:
            raise UsageError(f"{what}: folder {path} holds no .npz files")
        for f in files:
            with np.load(f, allow_pickle=False) as z:
                samples.append({k: np.asarray(z[k]) for k in z.files})
    elif path.suffix == ".npz":
        if not path.is_file():
            raise UsageError(f"{what}: file {path} does not exist")
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: np.asarray(z[k]) for k in z.files}
        except Exception as exc:  # noqa: BLE001 - numpy raises several types on a bad file
            raise UsageError(f"{what}: {path} is not a readable .npz ({exc})") from exc
        lengths = {k: (a.shape[0] if a.ndim else 0) for k, a in arrays.items()}
        if not arrays or len(set(lengths.values())) != 1:
            raise UsageError(f"{what}: arrays in {path} differ in their leading (sample) axis: {lengths}")
        for i in range(next(iter(lengths.values()))):
            samples.append(
                {k: (a[i : i + 1] if ranks.get(k) is not None and a.ndim == ranks[k] else a[i]) for k, a in arrays.items()}
            )
    elif ":" in text:
        func = load_function(text, what)
        try:
            samples = [{str(k): np.asarray(v) for k, v in feed.items()} for feed in func()]
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's function failed: one line
            raise UsageError(f"{what} {text}: the function failed ({type(exc).__name__}: {exc})") from exc
    else:
        raise UsageError(f"{what} {text!r}: not a folder of .npz files, a .npz of stacked samples, or module:function")
    if limit:
        samples = samples[:limit]
    if not samples:
        raise UsageError(f"{what} {text}: holds no samples")
    unknown = sorted({k for s in samples for k in s} - set(ranks))
    if unknown:
        raise UsageError(f"{what} {text}: unknown input(s) {unknown}; the model's inputs are {', '.join(ranks)}")
    return samples


def random_samples(model: Any, n: int, *, seed: int = 0, shapes: Mapping[str, Sequence[int]] | None = None) -> list[Feed]:
    """``n`` seeded random samples (as ``mograph diff`` makes them), seeds ``seed .. seed+n-1``."""
    from mograph.validate import make_feeds

    return [make_feeds(model, shapes=shapes, seed=seed + i)[0] for i in range(n)]


# ------------------------------------------------------------------------------------------- accuracy
def _floats(out: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(a, np.float64) for a in out.values() if np.issubdtype(np.asarray(a).dtype, np.floating)]


def accuracy(reference: Sequence[Mapping[str, np.ndarray]], outputs: Sequence[Mapping[str, np.ndarray]]) -> dict[str, float]:
    """Built-in accuracy metrics of ``outputs`` against ``reference`` (one dict per sample, same order)."""
    cosines, max_abs, agree, total = [], 0.0, 0, 0
    for ref, got in zip(reference, outputs):
        r_list, o_list = _floats(ref), _floats(got)
        if not r_list or len(r_list) != len(o_list):
            continue
        r = np.concatenate([a.ravel() for a in r_list])
        o = np.concatenate([a.ravel() for a in o_list])
        if r.shape != o.shape:
            raise UsageError(f"output sizes differ from the baseline's ({o.size} vs {r.size} elements)")
        nr, no = np.linalg.norm(r), np.linalg.norm(o)
        cosines.append(float(r @ o / (nr * no)) if nr > 0 and no > 0 else float(nr == no))
        finite = np.isfinite(r) & np.isfinite(o)
        diff = np.abs(r - o)
        max_abs = max(max_abs, float(diff[finite].max()) if finite.any() else float("inf"))
        if not finite.all():
            max_abs = float("inf")
        a, b = r_list[0], o_list[0]
        if a.ndim >= 1 and a.shape == b.shape and a.shape[-1] > 1:
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += int(np.prod(a.shape[:-1]))
    if not cosines:
        return {}
    out: dict[str, float] = {"cosine_mean": float(np.mean(cosines)), "cosine_min": float(np.min(cosines)), "max_abs": max_abs}
    if total:
        out["top1_agreement"] = agree / total
    return out


def call_task_metric(
    func: Callable[..., Any], outputs: list[Feed], samples: list[Feed], reference: list[Feed] | None
) -> dict[str, float]:
    """Call a user task metric; ``{"task_metric": x}`` for a number, ``{"task.NAME": x, ...}`` for a dict
    (the first entry also as ``task_metric``)."""
    kwargs: dict[str, Any] = {}
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    if "reference" in params:
        kwargs["reference"] = reference
    try:
        value = func(outputs, samples, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's metric failed: one line
        raise UsageError(f"task metric failed ({type(exc).__name__}: {exc})") from exc
    if isinstance(value, Mapping):
        out = {f"task.{k}": float(v) for k, v in value.items()}
        if value:
            out["task_metric"] = float(next(iter(value.values())))
        return out
    try:
        return {"task_metric": float(value)}
    except (TypeError, ValueError) as exc:
        raise UsageError(f"task metric returned {type(value).__name__}, not a number or a dict of numbers") from exc


# ------------------------------------------------------------------------------------------ measuring
@dataclass
class Target:
    """One model to measure."""

    name: str
    path: Path
    providers: list[str] | None = None
    ort_optimizations: bool = True
    threads: int | None = None
    backend: str = "ort"
    #: ONNX Runtime session config entries of the target's session (backend ``ort``)
    session_config: dict[str, str] | None = None


@dataclass
class Measured:
    """What :func:`measure` found for one target."""

    metrics: dict[str, Any] = field(default_factory=dict)
    outputs: list[Feed] = field(default_factory=list)
    providers: list[str] = field(default_factory=list)
    error: str | None = None
    #: Timed runs in seconds, one list per repeat; run ``i`` of every target in a repeat was timed in the
    #: same round as run ``i`` of the others (interleaved), so they pair up.
    latencies: list[list[float]] = field(default_factory=list)


class _Sampler:
    """Peak RSS during a block, from a background thread (``mograph bench``'s sampler); a no-op
    without psutil."""

    def __init__(self) -> None:
        try:
            from mograph.cli.bench import RssSampler

            self.inner: Any = RssSampler()
        except ImportError:
            self.inner = None

    def __enter__(self) -> _Sampler:
        if self.inner is not None:
            self.inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.inner is not None:
            self.inner.__exit__(*exc)

    @property
    def increase_mb(self) -> float | None:
        return None if self.inner is None else (self.inner.peak - self.inner.baseline) / 2**20


def _percentiles(latencies: list[float]) -> dict[str, float]:
    ms = np.asarray(latencies) * 1000.0
    return {
        "latency_p50_ms": float(np.percentile(ms, 50)),
        "latency_p90_ms": float(np.percentile(ms, 90)),
        "latency_p99_ms": float(np.percentile(ms, 99)),
        "latency_mean_ms": float(ms.mean()),
        "throughput": float(len(ms) / (ms.sum() / 1000.0)) if ms.sum() > 0 else float("nan"),
    }


def measure(
    targets: Sequence[Target],
    timing_feed: Feed,
    eval_samples: Sequence[Feed],
    *,
    warmup: int = 5,
    iterations: int = 50,
    blocked: Iterable[str] = (),
    progress: Callable[[str, int, int], None] | None = None,
    timing_feeds: Mapping[str, Feed] | None = None,
    repeats: int = 1,
    one_at_a_time: bool = False,
) -> dict[str, Measured]:
    """Measure ``targets`` side by side (see the module docstring); a target that fails to load or run
    gets ``error`` set and no metrics, the others are still measured.  ``timing_feeds`` gives a target
    its own timing feed (other shapes); the others use ``timing_feed``.  After ``warmup`` rounds, the
    ``iterations`` timed rounds are run ``repeats`` times (each target's runs kept per repeat in
    ``Measured.latencies``); the percentiles are over all of them.

    ``one_at_a_time``: each target's session is made, run on the samples, timed (its warm-up and rounds
    alone) and freed before the next target's is made, so at most one model's session is alive (the
    runtime's copies of several large models side by side are several times their weights); the timed
    runs are then not interleaved with the other targets'."""
    from mograph.backend_protocol import get_backend, registry_keywords, require_available
    from mograph.errors import MographError
    from mograph.plugins import get_registry

    registry = get_registry(blocked)
    backends = registry.backends
    results: dict[str, Measured] = {t.name: Measured() for t in targets}
    runners: dict[str, Callable[[Feed], dict[str, np.ndarray]]] = {}
    repeats = max(1, int(repeats))
    steps = len(targets) * (1 + len(eval_samples)) + (warmup + iterations * repeats) * len(targets)
    done = 0
    feed_of = {t.name: (timing_feeds or {}).get(t.name, timing_feed) for t in targets}

    def tick(phase: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(phase, done, steps)

    def open_target(t: Target) -> None:
        nonlocal done
        m = results[t.name]
        try:
            backend = get_backend(backends, t.backend, job="measure")
            require_available(backend)
            import_runtime = getattr(backend, "import_runtime", None)
            if callable(import_runtime):
                import_runtime()
            m.metrics["size_bytes"] = file_size(t.path)
            with _Sampler() as sampler:
                runner = backend.make_runner(
                    t.path, optimizations=t.ort_optimizations, threads=t.threads, providers=t.providers,
                    **registry_keywords(backend.make_runner, registry),
                    **({"session_config": t.session_config} if t.session_config else {}),
                )
                runner(feed_of[t.name])
            m.metrics["peak_mem_mb"] = sampler.increase_mb
            session = getattr(runner, "session", None)
            m.providers = list(session.get_providers()) if session is not None else list(t.providers or [])
            tick(f"session {t.name}")
            for sample in eval_samples:
                m.outputs.append({k: np.asarray(v) for k, v in runner(sample).items()})
                tick(f"eval {t.name}")
            runners[t.name] = runner
        except MographError as exc:
            m.error = str(exc)
            done += len(eval_samples) + warmup + iterations * repeats

    def time_rounds(live: list[str]) -> None:
        latencies: dict[str, list[list[float]]] = {n: [[] for _ in range(repeats)] for n in live}
        for r in range(warmup + iterations * repeats):
            order = live[r % len(live):] + live[: r % len(live)] if live else []
            for name in order:
                start = time.perf_counter()
                try:
                    runners[name](feed_of[name])
                except MographError as exc:
                    results[name].error = str(exc)
                    continue
                if r >= warmup:
                    latencies[name][(r - warmup) // iterations].append(time.perf_counter() - start)
                tick("warm-up" if r < warmup else "timing")
        for name in live:
            runs = [x for rep in latencies[name] for x in rep]
            if runs and results[name].error is None:
                results[name].metrics.update(_percentiles(runs))
                results[name].latencies = latencies[name]

    if one_at_a_time:
        from mograph import _spill

        for t in targets:
            open_target(t)
            if t.name in runners:
                time_rounds([t.name])
                del runners[t.name]  # the session goes before the next one is made
            _spill.free_dropped()
        return results
    for t in targets:
        open_target(t)
    time_rounds([t.name for t in targets if t.name in runners])
    with contextlib.suppress(Exception):
        runners.clear()
    return results
