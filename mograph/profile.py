"""Where the time goes: ONNX Runtime's profiler, summed per op type, per node, per CUDA kernel, and per
decomposed subgraph a fusion pass would replace (``mograph bench --profile``).

:func:`profile_model` runs the model ``warmup`` times, then ``runs`` times under ONNX Runtime's
profiler (one session, its graph optimizations as deployed unless ``optimizations=False``), feeds and
outputs bound on the device (IO binding), and returns a JSON-serialisable dict:

.. code-block:: text

    {
      "schema": "mograph.profile/1",
      "model": str, "backend": "ort", "runtime": "onnxruntime 1.x", "device": "cpu" | "cuda[:N]",
      "providers": [str], "ort_optimizations": bool, "runs": int, "warmup": int,
      "total_ms": float,     # summed node time of one run (mean over the runs): what pct divides
      "run_ms": float,       # wall time of one run (ORT's model_run event, mean), >= total_ms
      "node_timing": str,    # how node times were taken (see below)
      "by_op_type": [{"op_type", "ms", "pct", "count"}],     # slowest first; count = nodes of that type
      "top_nodes": [{"name", "op_type", "ms", "pct", "provider"}],   # the `top` slowest nodes
      "kernels": [{"name", "ms", "count"}],   # GPU kernels per run (count = launches per run); [] on CPU
      "kernels_source": str | None,          # "onnxruntime profiler" | "torch.profiler" | None
      "candidates": [{"kind", "instances", "ms", "pct", "fused", "nodes", "timed_nodes"}],
      "placement": {...},    # where nodes ran: mograph.backends._ort_profile.placement
      "notes": [str]
    }

Every ``ms`` is per run, summed over a row's nodes (or kernel launches); every ``pct`` is a share of
``total_ms``.  Node names and op types are those of the graph ONNX Runtime runs: after its own
fusions (nodes it fused are gone, and its fused nodes carry new names), with the ``Memcpy`` nodes it
inserted.  Unnamed nodes of the model are named ``<op_type>_<n>`` first, so every node can be found.

**Candidates**: the decomposed LayerNorm / RMSNorm / GELU / attention subgraphs of the model, as the
registered fusion passes' rules see them (:func:`decomposed_candidates`, each pass's read-only
:meth:`~mograph.pass_infra.Pass.candidates`: what a rule would fuse, and what dies with it): ``instances`` found, ``ms``/``pct`` the summed time
of their nodes that still ran under their own names (``timed_nodes`` of ``nodes``; the rest were fused
by ONNX Runtime itself, which ``--no-ort-optimizations`` turns off), ``fused: false``; and the fused ops
of each kind that ran (``LayerNormalization``, ``SkipLayerNormalization``, ``Attention``, ``Gelu``, ...,
whether from mograph or ONNX Runtime), ``fused: true``.  ``kind`` reads as "decomposed LayerNorm" or
"fused LayerNorm".

**Node times on CUDA.**  ONNX Runtime's node time is the host time of the node's ``Compute``, which on
CUDA only launches kernels.  So on CUDA the profiled runs happen in a child process with
``CUDA_LAUNCH_BLOCKING=1`` (each launch waits for its kernel), which makes node times GPU time plus
launch overhead (``node_timing`` says which was used).  Kernel names and times come from ONNX Runtime's
``Kernel`` events when its build has CUDA profiling, else from ``torch.profiler`` (CUDA activity, in this
process, runs not blocking) when torch is installed; otherwise ``kernels`` is empty and a note says why.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from mograph.errors import UsageError

if TYPE_CHECKING:
    from mograph.plugins import Registry

__all__ = ["profile_model", "format_profile", "decomposed_candidates", "SCHEMA"]

logger = logging.getLogger(__name__)

#: The ``schema`` key of :func:`profile_model`'s dict.
SCHEMA = "mograph.profile/1"


def _named_copy(model: ir.Model) -> bool:
    """Name the unnamed (or duplicate-named) nodes of ``model`` in place; whether any was renamed."""
    from mograph.irutil import fresh_name

    taken: set[str] = set()
    changed = False
    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    for node in nodes:
        if node.name and node.name not in taken:
            taken.add(node.name)
    seen: set[str] = set()
    for node in nodes:
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        node.name = fresh_name(taken, f"{node.op_type}_{len(taken)}")
        seen.add(node.name)
        changed = True
    return changed


def decomposed_candidates(model: ir.Model, registry: Registry) -> list[dict[str, Any]]:
    """The decomposed computations in ``model`` that the registered passes would fuse, read-only:
    ``[{"kind": "LayerNorm", "nodes": [node names], "pass": "fuse-layernorm", "op": "LayerNorm"}]``.

    The passes are asked as a pipeline would run them: on a copy of ``model`` after the ``cleanup``
    preset (which, for one, removes the no-op ``Cast`` s an exporter leaves inside an attention), each
    fusion pass on that same model (the ``fuse`` preset's order, then any other pass that answers
    :meth:`~mograph.pass_infra.Pass.candidates`, by name).  A region counts when its fused op declares the
    computation it is (``computes``) and it holds no op that already is one (a rule that adopts an
    exporter's ``LayerNormalization`` finds no *decomposed* LayerNorm); only nodes of ``model`` are listed
    (a node the cleanup made has no time of its own there), each in one region at most (the first's); a
    no-op node the cleanup removed (a ``Cast`` to the type it has) joins the region that alone reads it.
    """
    from mograph.foreign_ops import fused_kinds
    from mograph.ir_io import copy_model
    from mograph.pass_infra import Pass

    fused_of = fused_kinds(registry.custom_ops.values(), registry.foreign_ops)
    work = copy_model(model)
    for cleanup in registry.instantiate([n for n in registry.presets.get("cleanup", []) if n in registry.passes]):
        cleanup.call(work)
    op_type = {n.name: n.op_type for n in ir.traversal.RecursiveGraphIterator(work.graph) if n.name}
    own = {n.name for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.name}
    fuse = [n for n in registry.presets.get("fuse", []) if n in registry.passes]
    asked = [*fuse, *sorted(n for n in registry.passes if n not in fuse and registry.passes[n].candidates is not Pass.candidates)]
    taken: set[str] = set()
    found: list[dict[str, Any]] = []
    for name in asked:
        (pass_,) = registry.instantiate([name])
        for cand in pass_.candidates(work):
            if cand.reason is not None or cand.kind is None or any(op_type.get(n) in fused_of for n in cand.nodes):
                continue
            nodes = [n for n in cand.nodes if n in own and n not in taken]
            if nodes:
                taken.update(nodes)
                found.append({"kind": cand.kind, "nodes": nodes, "pass": name, "op": cand.op})
    # A node the cleanup removed as a no-op (a Cast to the same type: it reads a node that stayed) whose
    # readers all are in one region goes with that region; a folded shape computation does not.
    region = {n: i for i, c in enumerate(found) for n in c["nodes"]}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if not node.name or node.name in op_type or any(v.is_graph_output() for v in node.outputs):
            continue
        stayed = any(p is not None and p.name in op_type and p.op_type != "Constant"
                     for p in (v.producer() if v is not None else None for v in node.inputs))
        readers = {region.get(u.name or "") for v in node.outputs for u, _ in v.uses()}
        if stayed and len(readers) == 1 and None not in readers:
            (i,) = readers
            found[i]["nodes"].append(node.name)  # type: ignore[index]
    return found


def _profiled_events(
    model: Any, feeds: Mapping[str, np.ndarray], runs: int, warmup: int, device: str,
    optimizations: bool, threads: int | None, config: Mapping[str, str] | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Run ``model`` (a path) ``warmup + runs`` times under ONNX Runtime's profiler; return the events
    worth keeping (Session / Node / Kernel) and the session's providers."""
    from mograph.backends import _ort_profile, ort

    folder = tempfile.mkdtemp(prefix="mograph-profile-")
    try:
        session = ort.make_session(
            model, optimizations=optimizations, threads=threads,
            device=device if device != "cpu" else None, profile_prefix=os.path.join(folder, "ort"), config=config,
        )
        runner = ort.OrtRunner(session, device=device)
        step = runner.bind(feeds)
        for _ in range(warmup + runs):
            step()
        written = session.end_profiling()
        events = _ort_profile.read_events(written)
        providers = list(session.get_providers())
    finally:
        for name in os.listdir(folder):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    keep = [
        {k: e[k] for k in ("cat", "name", "ts", "dur") if k in e}
        | {"args": {k: v for k, v in (e.get("args") or {}).items() if k in ("op_name", "provider")}}
        for e in events
        if e.get("cat") in ("Session", "Node", "Kernel")
    ]
    return keep, providers


def _child(queue: Any, *args: Any) -> None:  # pragma: no cover - runs in a spawned process
    try:
        queue.put(("ok", _profiled_events(*args)))
    except BaseException as exc:  # noqa: BLE001 - sent back to the parent, which raises it
        queue.put(("error", (type(exc), str(exc))))


def _events_launch_blocking(*args: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """:func:`_profiled_events` in a spawned child with ``CUDA_LAUNCH_BLOCKING=1``."""
    import queue as queue_mod

    from mograph.errors import ModelError, MographError

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    old = os.environ.get("CUDA_LAUNCH_BLOCKING")
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"  # for the child: it reads it when it sets CUDA up
    try:
        proc = ctx.Process(target=_child, args=(queue, *args), daemon=True)
        proc.start()
    finally:
        if old is None:
            os.environ.pop("CUDA_LAUNCH_BLOCKING", None)
        else:
            os.environ["CUDA_LAUNCH_BLOCKING"] = old
    try:
        while True:
            try:
                status, payload = queue.get(timeout=1.0)
                break
            except queue_mod.Empty:
                if not proc.is_alive():
                    raise ModelError(f"the profiling process died (exit code {proc.exitcode})") from None
    finally:
        proc.join(timeout=30)
    if status == "error":
        cls, message = payload
        if isinstance(cls, type) and issubclass(cls, MographError):
            err = cls.__new__(cls)  # the message as is, whatever the class's own __init__ takes
            Exception.__init__(err, message)
            raise err
        raise ModelError(f"profiling failed: {cls.__name__}: {message}")
    return payload  # type: ignore[no-any-return]


def _torch_kernels(model: Any, feeds: Mapping[str, np.ndarray], runs: int, device: str,
                   optimizations: bool, threads: int | None,
                   config: Mapping[str, str] | None = None) -> list[dict[str, Any]] | str:
    """GPU kernels of ``runs`` IO-bound runs seen by ``torch.profiler``; a sentence when it cannot."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "no CUDA kernel events: this onnxruntime build has no CUDA profiling and torch is not installed"
    from mograph.backends import ort

    try:
        import torch
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
    except Exception as exc:  # noqa: BLE001
        return f"no CUDA kernel events: torch.profiler is not usable ({exc})"
    session = ort.make_session(model, optimizations=optimizations, threads=threads, device=device, config=config)
    runner = ort.OrtRunner(session, device=device)
    step = runner.bind(feeds)
    for _ in range(3):
        step()
    # CPU activity too: kineto then always correlates the launches; CPU-side events have no device time
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            step()
        torch.cuda.synchronize()
    out = []
    for ev in prof.key_averages():
        us = float(getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0) or 0.0)
        if us <= 0:
            continue
        out.append({"name": str(ev.key), "ms": us / 1000.0 / runs, "count": max(1, round(int(ev.count) / runs))})
    return sorted(out, key=lambda k: -k["ms"])


def profile_model(
    model_path: Any,
    backend: Any = "ort",
    feeds: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    runs: int = 10,
    *,
    device: str | None = "cpu",
    warmup: int = 3,
    optimizations: bool = True,
    threads: int | None = None,
    top: int = 10,
    shapes: Mapping[str, Any] | None = None,
    seed: int = 0,
    kernels: bool | None = None,
    launch_blocking: bool | None = None,
    registry: Registry | None = None,
    session_config: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Profile ``model_path`` and say where its time goes (the dict described in the module docstring).

    Args:
        model_path: a path to an ``.onnx`` file (or an ``onnx_ir.Model`` / ``ModelProto`` / bytes).
        backend: ``"ort"`` or the ``ort`` backend object: profiling reads ONNX Runtime's profiler.
        feeds: input arrays by name, or an ``.npz`` path; ``None``: seeded random feeds
            (:func:`mograph.validate.make_feeds`, sized by ``shapes``).
        runs: profiled runs (after ``warmup`` unprofiled ones in the same session).
        device: ``"cpu"`` or ``"cuda"``/``"cuda:N"`` (exit code 7 without onnxruntime-gpu).
        optimizations: ONNX Runtime's own graph optimizations (on, as deployed).
        threads: intra-op threads.
        top: how many nodes (and kernels) to list.
        kernels: collect GPU kernels (default: on CUDA).
        launch_blocking: take node times in a child process with ``CUDA_LAUNCH_BLOCKING=1`` (default:
            on CUDA); also usable on the CPU, where it changes nothing but the process.
        registry: the plugins' registry (its custom ops are lowered for ``ort`` first); default: the
            current environment's (this is a composition root).
        session_config: ONNX Runtime session config entries of the profiled sessions.

    Raises:
        UsageError: another backend than ``ort``, or ``runs``/``top`` below 1.
        BackendUnavailableError: onnxruntime (or, for CUDA, its CUDA provider) is missing.
        ModelError: the model cannot be loaded or run.
    """
    from mograph import ir_io
    from mograph.backends import _ort_profile, ort
    from mograph.foreign_ops import fused_kinds
    from mograph.lowering import lowered_for
    from mograph.validate import make_feeds

    name = backend if isinstance(backend, str) else getattr(backend, "name", "?")
    if name != "ort":
        raise UsageError(f"profiling reads ONNX Runtime's profiler: it needs --backend ort, not '{name}'")
    if runs < 1 or top < 1 or warmup < 0:
        raise UsageError("profile: runs and top must be at least 1, warmup at least 0")
    kind, _ = ort.parse_device(device)
    device = "cpu" if kind == "cpu" else str(device)
    if kind == "cuda":
        ort.require_device(device)
    notes: list[str] = []
    loaded = ir_io.load_model(model_path) if not isinstance(model_path, ir.Model) else model_path
    if registry is None:
        from mograph.plugins import get_registry

        registry = get_registry()
    run_model, lowered = lowered_for(loaded, "ort", registry=registry)
    if lowered:
        notes.append("fused custom ops were lowered for ONNX Runtime first: " + ", ".join(f"{k}={v}" for k, v in lowered.items()))
    if run_model is loaded:
        run_model = ir_io.copy_model(loaded) if isinstance(model_path, ir.Model) else loaded
    renamed = _named_copy(run_model)
    if renamed:
        notes.append("unnamed nodes were named <op_type>_<n> for the profile")
    if feeds is None or isinstance(feeds, (str, os.PathLike)):
        feed_arrays, _info = make_feeds(run_model, shapes=shapes, feeds=feeds, seed=seed)
    else:
        feed_arrays = {k: np.asarray(v) for k, v in feeds.items()}
    candidates_found = decomposed_candidates(run_model, registry)

    tmp = tempfile.mkdtemp(prefix="mograph-profile-model-")
    try:
        if not renamed and not lowered and isinstance(model_path, (str, os.PathLike)):
            payload: Any = os.fspath(model_path)
        else:
            payload = os.path.join(tmp, "model.onnx")
            ir_io.save_model(run_model, payload, external_data=ort.needs_file(run_model))  # attributes' data too
        blocking = (kind == "cuda") if launch_blocking is None else bool(launch_blocking)
        args = (payload, feed_arrays, runs, warmup, device, optimizations, threads, session_config)
        if blocking:
            events, providers = _events_launch_blocking(*args)
            node_timing = (
                "ONNX Runtime node events in a child process with CUDA_LAUNCH_BLOCKING=1 (each node's time "
                "includes its kernels and their launch)"
            )
        else:
            events, providers = _profiled_events(*args)
            node_timing = "ONNX Runtime node events (host time of each node's Compute)"
            if kind == "cuda":
                node_timing += "; on CUDA that is kernel launch time, not GPU time"
        kernel_rows = _ort_profile.kernel_times(events, runs)
        kernels_source: str | None = "onnxruntime profiler" if kernel_rows else None
        want_kernels = (kind == "cuda") if kernels is None else bool(kernels)
        if want_kernels and not kernel_rows and kind == "cuda":
            got = _torch_kernels(payload, feed_arrays, runs, device, optimizations, threads, session_config)
            if isinstance(got, str):
                notes.append(got)
            else:
                kernel_rows, kernels_source = got, "torch.profiler (CUDA activity)"
    finally:
        for f in os.listdir(tmp):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(tmp, f))
        with contextlib.suppress(OSError):
            os.rmdir(tmp)

    nodes, runs_seen = _ort_profile.node_times(events, runs)
    if runs_seen < runs:
        notes.append(f"the profile held {runs_seen} run(s), not {runs}")
    windows = _ort_profile.run_windows(events, runs)
    run_ms = float(np.mean([(end - start) / 1000.0 for start, end in windows])) if windows else 0.0
    total = sum(n["ms"] for n in nodes)

    def pct(ms: float) -> float:
        return 100.0 * ms / total if total > 0 else 0.0

    by_type: dict[str, dict[str, Any]] = {}
    for n in nodes:
        row = by_type.setdefault(n["op_type"], {"op_type": n["op_type"], "ms": 0.0, "count": 0})
        row["ms"] += n["ms"]
        row["count"] += 1
    by_op_type = sorted(({**r, "pct": pct(r["ms"])} for r in by_type.values()), key=lambda r: -r["ms"])
    top_nodes = [
        {"name": n["name"], "op_type": n["op_type"], "ms": n["ms"], "pct": pct(n["ms"]), "provider": n["provider"]}
        for n in sorted(nodes, key=lambda n: -n["ms"])[:top]
    ]
    ms_by_name = {n["name"]: n["ms"] for n in nodes}
    fused_of = fused_kinds(registry.custom_ops.values(), registry.foreign_ops)  # op type -> the computation
    candidates = []
    kinds = dict.fromkeys([*fused_of.values(), *(c["kind"] for c in candidates_found)])  # declarations' order
    for k in kinds:
        found = [c for c in candidates_found if c["kind"] == k]
        if found:
            names = [nm for c in found for nm in c["nodes"]]
            timed = [nm for nm in names if nm in ms_by_name]
            ms = sum(ms_by_name[nm] for nm in timed)
            candidates.append({"kind": f"decomposed {k}", "instances": len(found), "ms": ms, "pct": pct(ms),
                               "fused": False, "nodes": len(names), "timed_nodes": len(timed)})
        fused = [n for n in nodes if fused_of.get(n["op_type"]) == k]
        if fused:
            ms = sum(n["ms"] for n in fused)
            candidates.append({"kind": f"fused {k}", "instances": len(fused), "ms": ms, "pct": pct(ms),
                               "fused": True, "nodes": len(fused), "timed_nodes": len(fused),
                               "op_types": sorted({n["op_type"] for n in fused})})
    if any(not c["fused"] and c["timed_nodes"] < c["nodes"] for c in candidates):
        notes.append("some nodes of decomposed subgraphs did not run under their names: ONNX Runtime's own "
                     "graph optimizations fused or removed them (--no-ort-optimizations shows their cost as written)")
    device_provider = ort.CUDA_PROVIDER if kind == "cuda" else "CPUExecutionProvider"
    return {
        "schema": SCHEMA,
        "model": str(model_path) if isinstance(model_path, (str, os.PathLike)) else "(in memory)",
        "backend": "ort",
        "runtime": f"onnxruntime {ort.ort_version()}",
        "device": device,
        "providers": providers,
        "ort_optimizations": bool(optimizations),
        "runs": runs,
        "warmup": warmup,
        "total_ms": total,
        "run_ms": run_ms,
        "node_timing": node_timing,
        "by_op_type": by_op_type,
        "top_nodes": top_nodes,
        "kernels": kernel_rows[:top] if kernel_rows else [],
        "kernels_total": len(kernel_rows),
        "kernels_source": kernels_source,
        "candidates": candidates,
        "placement": _ort_profile.placement(events, device_provider),
        "notes": notes,
    }


def format_profile(profile: Mapping[str, Any]) -> str:
    """:func:`profile_model`'s dict as tables, for people."""
    lines = [
        f"profile:    {profile['runs']} run(s) on {profile['device']} after {profile['warmup']} warm-up; "
        f"{profile['total_ms']:.3f} ms in nodes per run ({profile['run_ms']:.3f} ms wall); {profile['node_timing']}",
        "",
        f"  {'op type':<28} {'ms/run':>9} {'share':>7} {'nodes':>6}",
    ]
    for r in profile["by_op_type"]:
        lines.append(f"  {r['op_type']:<28} {r['ms']:>9.3f} {r['pct']:>6.1f}% {r['count']:>6}")
    lines += ["", f"  top {len(profile['top_nodes'])} nodes:"]
    width = max([len(n["name"]) for n in profile["top_nodes"]] + [4])
    width = min(width, 60)
    for n in profile["top_nodes"]:
        nm = n["name"] if len(n["name"]) <= width else "..." + n["name"][-(width - 3):]
        prov = n["provider"].replace("ExecutionProvider", "")
        lines.append(f"  {nm:<{width}} {n['op_type']:<20} {n['ms']:>9.3f} {n['pct']:>6.1f}%  {prov}")
    if profile["candidates"]:
        lines += ["", "  fusion candidates (decomposed: what a fusion pass would replace; fused: already one op):"]
        for c in profile["candidates"]:
            extra = ""
            if not c["fused"] and c["timed_nodes"] < c["nodes"]:
                extra = f"  ({c['timed_nodes']} of {c['nodes']} nodes ran as written; ONNX Runtime fused the rest)"
            elif c["fused"]:
                extra = f"  ({', '.join(c.get('op_types', []))})"
            lines.append(f"  {c['kind']:<24} {c['instances']:>4} instance(s) {c['ms']:>9.3f} ms {c['pct']:>6.1f}% of time{extra}")
    if profile["kernels"]:
        lines += ["", f"  top {len(profile['kernels'])} of {profile.get('kernels_total', len(profile['kernels']))} "
                  f"CUDA kernels ({profile['kernels_source']}):"]
        for k in profile["kernels"]:
            nm = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
            lines.append(f"  {k['ms']:>9.3f} ms  x{k['count']:<4} {nm}")
    for note in profile.get("notes", []):
        lines.append(f"  note: {note}")
    return "\n".join(lines)
