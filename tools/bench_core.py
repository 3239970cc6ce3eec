"""Benchmark the core job — load + ``cleanup`` preset + save — against onnxslim on the same BERT export.

For each layer count (``--layers 12,48``) a ``transformers.BertModel`` with random weights is exported
once with the TorchScript exporter at opset 17 (dynamic ``batch`` and ``seq``; cached in ``--model-dir``).
``--config base`` (the default) is the real BERT-base shape: ``BertConfig()`` defaults (hidden 768,
12 heads, FFN 3072, vocab 30522, 512 positions) with only ``num_hidden_layers`` changed, and seeded noise
on every parameter so that no two biases are identical zeros.  ``--config export-hf`` uses
``models.export_hf.export("bert", ..., hidden=768)`` instead, whose config is narrower (4 heads,
FFN 1536, vocab 100, 128 positions): the same graph topology with about half the weights.

Then, in the same run, each tool processes each model ``--repeats`` times, interleaved (the order of
the tools alternates between repetitions, and repetitions loop over all layer counts), each time in a
fresh Python subprocess so that neither tool profits from the other's caches or warm imports:

* ``mograph``: ``mograph.optimize(path, passes="cleanup")`` then ``mograph.save``;
* ``onnxslim``: ``onnxslim.slim(path, output)`` with its defaults (which also fuse some patterns).

The timed span starts after the tool's top-level ``import`` and ends when the output file is written;
the subprocess wall time (interpreter start and imports included) is reported beside it.  Peak RSS is
the subprocess's own ``VmHWM``.  After timing, each tool's output is checked with ``onnx.checker`` and run
once with ONNX Runtime (graph optimizations off) on seeded feeds against the input model: the table shows
the largest absolute difference over all outputs.

``--profile mograph`` (or ``onnxslim``) runs one extra, untimed subprocess per layer count under cProfile
and prints the functions that dominate.  ``--json FILE`` writes every number.

Run:  python tools/bench_core.py [--layers 12,48] [--repeats 3] [--profile mograph] [--json out.json]
Needs: torch, transformers, onnxslim, onnxruntime.

**Scaling mode** (``--scaling 1000,10000,100000``): how ``cleanup,fuse`` grows with graph size.  For each
node count a LLaMA-style decoder (RMSNorm, GQA attention with rotary embeddings, SiLU-gated MLP, each
layer spelled as the TorchScript exporter spells it: ``Pow``/``ReduceMean``/``Sqrt``/``Reciprocal``,
``Shape``/``Gather``/``Concat`` reshape targets) is built in code with ``onnx.helper`` -- no torch --
with as many stacked layers as give that many nodes (about 84 a layer), weights inside the protobuf
(``--hidden`` sets their width).  Each model then goes, each in a fresh subprocess with its own time
limit (``--timeout``), through:

* ``mograph``: ``mograph.optimize(path, passes="cleanup,fuse")`` then ``mograph.save`` (per-pass wall seconds
  kept, and each pass's CPU seconds, measured by an instrument: the per-pass shares printed are CPU shares);
* ``ort``: ONNX Runtime's transformers optimizer, ``optimize_model(path, model_type="gpt2",
  num_heads=..., hidden_size=..., opt_level=0)`` then ``save_model_to_file`` (the reference);
* ``inspect``: ``mograph.inspect.summarize(path)``.

The table gives seconds, the worker process's CPU seconds (on a machine shared with other jobs the wall
time mostly measures the load; the CPU time does not), peak RSS and peak RSS over the model's bytes per
tool and size, and the time ratio of the largest size to the 10k one.  ``--model FILE`` adds an existing
model (e.g. a 30-layer LLaMA export) to the same table; with ``--scaling`` and no sizes only the given
models run.  ``--markdown FILE`` also writes the table and the per-pass breakdown as markdown.

Results are kept in ``benchmarks/scaling.md``.  Session 10 (2026-12-03 morning, shared 2-core CPU box, with
save): 1k nodes 0.8 CPU-s, 10k 4.9-5.1, 30k 14.5-15.7, 100k 50.1-53.9 (x10.3-10.6 the 10k one), peak 159 / 248 /
449 / 1,111 MiB; the 30-layer LLaMA export (622 MiB of in-protobuf weights) 4.8 CPU-s, peak 903 MiB (1.45x its
bytes); largest pass fold-constants, 20-23% of the passes' CPU time at every size.  Session 11 (same day, another
helper's jobs beside it: both codes slower): 10k 5.8-6.1, 100k 61.9-62.7 (x10.3-10.6), peak 248 / 1,110 MiB;
LLaMA 7.5 CPU-s, peak 903 MiB, fold-constants 20%.  Session 12 (load average about 2.5, the shape query's sweep
made cheaper): 1k 0.9, 10k 5.75, 30k 17.7, 100k 60.2 (x10.5), peak 159 / 248 / 449 / 1,110 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("mograph", "onnxslim")
OPSET = 17


# ------------------------------------------------------------------------------------------ export


def _export_base(path: Path, layers: int, seed: int = 0) -> None:
    """BertConfig defaults (BERT-base) with ``layers`` layers, seeded noise on every parameter."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    bert = BertModel(BertConfig(num_hidden_layers=layers, attn_implementation="eager"))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, param in sorted(bert.named_parameters()):
            param.add_(0.02 * torch.randn(param.shape, generator=gen, dtype=param.dtype))

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
            return out.last_hidden_state, out.pooler_output

    module = Wrapped().eval()
    ids = torch.randint(0, 1000, (2, 16), generator=gen)
    mask = torch.ones(2, 16, dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    with torch.no_grad():
        torch.onnx.export(
            module, (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
            output_names=["last_hidden_state", "pooler_output"], opset_version=OPSET, dynamo=False,
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "last_hidden_state": axes,
                          "pooler_output": {0: "batch"}},
            do_constant_folding=True,
        )  # fmt: skip


def _export_worker(config: str, layers: int, path: str) -> None:
    tmp = Path(path + ".part")
    if config == "base":
        _export_base(tmp, layers)
    else:
        sys.path.insert(0, str(ROOT))
        from models.export_hf import export

        export("bert", tmp, exporter="torchscript", opset=OPSET, layers=layers, hidden=768)
    os.replace(tmp, path)


def ensure_model(model_dir: Path, config: str, layers: int) -> tuple[Path, float | None]:
    """The exported model's path, exporting it in a subprocess unless cached; and the export seconds."""
    path = model_dir / f"bert-{config}-L{layers}-op{OPSET}.onnx"
    if path.exists():
        return path, None
    model_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--_export", config, str(layers), str(path)], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    if proc.returncode != 0:  # the exporter's warnings are noise unless it failed
        raise RuntimeError(f"export of {layers} layers failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return path, time.perf_counter() - start


# ------------------------------------------------------------------------------------------ workers


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    """This process's own peak RSS (``VmHWM``).  Not ``ru_maxrss``: Linux carries the parent's peak into a
    child across ``vfork``+``exec``, so a parent that once held a big model would inflate every reading."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _tool_worker(tool: str, src: str, dst: str, result_path: str, profile_path: str | None) -> None:
    """Run one tool once on ``src`` in this (fresh) process; write timings and peak RSS as JSON."""
    t_imp = time.perf_counter()
    if tool == "mograph":
        import mograph
    else:
        import onnxslim
    import_s = time.perf_counter() - t_imp
    rss_base = _rss_now()
    out: dict[str, Any] = {"import_s": import_s, "rss_after_import": rss_base}

    def job() -> None:
        if tool == "mograph":
            start = time.perf_counter()
            model, report = mograph.optimize(src, passes="cleanup")
            mid = time.perf_counter()
            mograph.save(model, dst)
            end = time.perf_counter()
            passes = {p.name: p.seconds for p in report.passes}
            out["phases"] = {"load+setup": mid - start - sum(passes.values()), **passes, "save": end - mid}
        else:
            onnxslim.slim(src, dst)

    profiler = None
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    job()
    out["seconds"] = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile_path)
    out["peak_rss"] = _peak_rss()
    Path(result_path).write_text(json.dumps(out))


def run_tool(tool: str, src: Path, dst: Path, profile: Path | None = None) -> dict[str, Any]:
    """One fresh subprocess running ``tool`` on ``src``; its measurements plus the process wall time."""
    result = dst.with_suffix(".result.json")
    for stale in (dst, result):
        stale.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--_worker", tool, str(src), str(dst), str(result)]
    if profile is not None:
        cmd.append(str(profile))
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"{tool} failed on {src.name} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    data = json.loads(result.read_text())
    data["process_s"] = wall
    return data


# ------------------------------------------------------------------------------------------ checks


def node_count(path: Path) -> int:
    import onnx

    return len(onnx.load(str(path), load_external_data=False).graph.node)


def file_bytes(path: Path) -> int:
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def checker_error(path: Path) -> str | None:
    import onnx

    try:
        onnx.checker.check_model(str(path))
    except Exception as exc:  # noqa: BLE001 - report whatever the checker says
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def _session(path: Path) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def feeds(batch: int = 2, seq: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 100, size=(batch, seq), dtype=np.int64)  # < 100: valid for both configs' vocab
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[1:, seq // 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def run_outputs(path: Path, data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = _session(path)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, data)))


def max_abs_diff(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> float:
    if set(ref) != set(got):
        return float("nan")
    return max(float(np.max(np.abs(ref[k].astype(np.float64) - got[k].astype(np.float64)))) for k in ref)


# ------------------------------------------------------------------------------------------ profile


def print_profile(path: Path, top: int) -> dict[str, Any]:
    """Print the top functions by cumulative and own time; return them for --json."""
    import pstats

    stats = pstats.Stats(str(path))
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = []
    for (file, line, func), (_cc, ncalls, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{_short(file)}:{line}({func})"
        rows.append({"function": where, "calls": ncalls, "own_s": tt, "cum_s": ct})
    by_cum = sorted(rows, key=lambda r: -r["cum_s"])[:top]
    by_own = sorted(rows, key=lambda r: -r["own_s"])[:top]
    for title, key, chosen in (("cumulative", "cum_s", by_cum), ("own time", "own_s", by_own)):
        print(f"  top {top} by {title} (profiled total {total:.2f}s):")
        for r in chosen:
            print(f"    {r[key]:8.2f}s {100 * r[key] / total:5.1f}%  {r['calls']:>9}  {r['function']}")
    return {"total_s": total, "by_cumulative": by_cum, "by_own": by_own}


def _short(file: str) -> str:
    for marker in ("site-packages/", "/work/main/"):
        if marker in file:
            return file.split(marker, 1)[1]
    return file


# ------------------------------------------------------------------------------------------ scaling

SCALE_TOOLS = ("mograph", "ort", "inspect")
_NODES_PER_LAYER = 84  # nodes of one layer of :func:`build_llama_stack` (checked after building)


def build_llama_stack(layers: int, hidden: int = 32, heads: int = 4, kv_heads: int = 2, inter: int | None = None,
                      vocab: int = 256, max_pos: int = 128, seed: int = 0, opset: int = 17) -> Any:
    """A LLaMA-style decoder of ``layers`` stacked layers as an ``onnx.ModelProto`` (TorchScript's spelling).

    Inputs ``input_ids`` and ``attention_mask`` (int64, [batch, seq]); output ``logits``.  Weights are
    seeded normal noise inside the protobuf.
    """
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inter = inter or 2 * hidden
    d = hidden // heads
    nodes: list[Any] = []
    inits: list[Any] = []
    count = [0]

    def fresh(prefix: str) -> str:
        count[0] += 1
        return f"{prefix}_{count[0]}"

    def init(arr: Any, prefix: str = "w") -> str:
        name = fresh(prefix)
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def node(op: str, inputs: list[str], **attrs: Any) -> str:
        out = fresh(op.lower())
        nodes.append(helper.make_node(op, inputs, [out], name=fresh("/" + op), **attrs))
        return out

    def f32(a: Any) -> Any:
        return np.asarray(a, dtype=np.float32)

    def i64(a: Any) -> Any:
        return np.asarray(a, dtype=np.int64)

    two, eps, scale = init(f32(2.0), "two"), init(f32(1e-5), "eps"), init(f32(np.sqrt(d)), "scale")
    c0, c2, cm1, big = init(i64([0]), "c0"), init(i64([2]), "c2"), init(i64([-1]), "cm1"), init(i64([2**62]), "big")
    emb = init(f32(rng.standard_normal((vocab, hidden)) * 0.02), "embed")
    x = node("Gather", [emb, "input_ids"])
    seq = node("Unsqueeze", [node("Gather", [node("Shape", ["input_ids"]), init(i64(1), "one")]), c0])
    pos = np.arange(max_pos)[:, None] / (10000 ** (np.arange(0, d, 2) / d))[None]
    pos = np.concatenate([pos, pos], -1)
    cos = node("Slice", [init(f32(np.cos(pos)), "cos"), c0, seq, c0])
    sin = node("Slice", [init(f32(np.sin(pos)), "sin"), c0, seq, c0])
    mask = node("Mul", [node("Sub", [init(f32(1.0), "one_f"), node("Cast", ["attention_mask"], to=TensorProto.FLOAT)]),
                        init(f32(-1e4), "neg")])
    mask = node("Unsqueeze", [mask, init(i64([1, 2]), "ax12")])

    def rms(v: str) -> str:
        mean = node("ReduceMean", [node("Pow", [v, two])], axes=[-1], keepdims=1)
        r = node("Reciprocal", [node("Sqrt", [node("Add", [mean, eps])])])
        return node("Mul", [init(f32(1 + 0.1 * rng.standard_normal(hidden)), "norm_w"), node("Mul", [v, r])])

    def split_heads(v: str, n: int) -> str:
        s = node("Shape", [v])
        b, t = node("Gather", [s, init(i64(0), "i0")]), node("Gather", [s, init(i64(1), "i1")])
        target = node("Concat", [node("Unsqueeze", [b, c0]), node("Unsqueeze", [t, c0]), init(i64([n]), "nh"),
                                 init(i64([d]), "hd")], axis=0)
        return node("Transpose", [node("Reshape", [v, target])], perm=[0, 2, 1, 3])

    def rope(v: str) -> str:
        first = node("Slice", [v, c0, init(i64([d // 2]), "half"), cm1])
        second = node("Slice", [v, init(i64([d // 2]), "half"), big, cm1])
        rotated = node("Concat", [node("Neg", [second]), first], axis=-1)
        return node("Add", [node("Mul", [v, cos]), node("Mul", [rotated, sin])])

    def weight(i: int, o: int) -> str:
        return init(f32(rng.standard_normal((i, o)) * 0.05), "W")

    def repeat_kv(v: str) -> str:
        rep = heads // kv_heads
        if rep == 1:
            return v
        expanded = node("Expand", [node("Unsqueeze", [v, c2]), init(i64([1, 1, rep, 1, 1]), "rep")])
        return node("Reshape", [expanded, init(i64([0, heads, -1, d]), "kv_shape")])

    for _ in range(layers):
        h = rms(x)
        q = rope(split_heads(node("MatMul", [h, weight(hidden, hidden)]), heads))
        k = repeat_kv(rope(split_heads(node("MatMul", [h, weight(hidden, kv_heads * d)]), kv_heads)))
        v = repeat_kv(split_heads(node("MatMul", [h, weight(hidden, kv_heads * d)]), kv_heads))
        scores = node("Div", [node("MatMul", [q, node("Transpose", [k], perm=[0, 1, 3, 2])]), scale])
        probs = node("Softmax", [node("Add", [scores, mask])], axis=-1)
        o = node("Transpose", [node("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        s = node("Shape", [o])
        b, t = node("Gather", [s, init(i64(0), "i0")]), node("Gather", [s, init(i64(1), "i1")])
        target = node("Concat", [node("Unsqueeze", [b, c0]), node("Unsqueeze", [t, c0]), init(i64([hidden]), "hid")],
                      axis=0)
        x = node("Add", [x, node("MatMul", [node("Reshape", [o, target]), weight(hidden, hidden)])])
        h = rms(x)
        gate = node("MatMul", [h, weight(hidden, inter)])
        gate = node("Mul", [gate, node("Sigmoid", [gate])])
        up = node("MatMul", [h, weight(hidden, inter)])
        x = node("Add", [x, node("MatMul", [node("Mul", [gate, up]), weight(inter, hidden)])])
    x = rms(x)
    node("MatMul", [x, node("Transpose", [emb], perm=[1, 0])])
    nodes[-1].output[0] = "logits"
    graph = helper.make_graph(
        nodes, "llama_stack",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in ("input_ids", "attention_mask")],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab])], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def ensure_stack(model_dir: Path, nodes: int, hidden: int) -> tuple[Path, int]:
    """The synthetic model of about ``nodes`` nodes (cached); and its layer count."""
    import onnx

    layers = max(1, round(nodes / _NODES_PER_LAYER))
    path = model_dir / f"llama-stack-L{layers}-H{hidden}.onnx"
    if not path.exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        heads = max(4, hidden // 64)
        model = build_llama_stack(layers, hidden=hidden, heads=heads, kv_heads=heads // 2)
        tmp = path.with_suffix(".part")
        onnx.save(model, str(tmp))
        os.replace(tmp, path)
    return path, layers


def _scale_worker(tool: str, src: str, dst: str, result_path: str, heads: str, hidden: str) -> None:
    """Run one tool once on ``src`` in this (fresh) process; write timings and peak RSS as JSON."""
    t_imp = time.perf_counter()
    if tool == "mograph":
        import mograph
    elif tool == "inspect":
        import mograph.inspect
    else:
        from onnxruntime.transformers.optimizer import optimize_model
    out: dict[str, Any] = {"import_s": time.perf_counter() - t_imp, "rss_after_import": _rss_now()}
    start, cpu_start = time.perf_counter(), time.process_time()
    if tool == "mograph":
        pass_cpu: list[list[Any]] = []

        def cpu_per_pass(pass_: Any, model: Any, context: Any) -> Any:  # an instrument: each pass's CPU time
            t = time.process_time()
            result = yield
            pass_cpu.append([pass_.name, time.process_time() - t])
            return result

        model, report = mograph.optimize(src, passes="cleanup,fuse", instruments=[cpu_per_pass])
        mid = time.perf_counter()
        mograph.save(model, dst, overwrite=True)
        out["passes"] = [[p.name, p.seconds] for p in report.passes]
        out["pass_cpu"] = pass_cpu
        out["save_s"] = time.perf_counter() - mid
        out["nodes_out"] = sum(1 for _ in model.graph)
    elif tool == "inspect":
        summary = mograph.inspect.summarize(src)
        out["nodes_out"] = summary["nodes"]["total"]
    else:
        opt = optimize_model(src, model_type="gpt2", num_heads=int(heads), hidden_size=int(hidden), opt_level=0)
        opt.save_model_to_file(dst)
        out["nodes_out"] = len(opt.model.graph.node)
    out["seconds"] = time.perf_counter() - start
    out["cpu_s"] = time.process_time() - cpu_start  # this process's CPU time: what a shared machine's load leaves
    out["peak_rss"] = _peak_rss()
    Path(result_path).write_text(json.dumps(out))


def run_scale_tool(tool: str, src: Path, dst: Path, heads: int, hidden: int, timeout: float) -> dict[str, Any]:
    """One fresh subprocess; its measurements, or ``{"error": ...}`` (time limit, crash)."""
    result = dst.with_suffix(".result.json")
    for stale in (dst, result):
        stale.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--_scale_worker", tool, str(src), str(dst), str(result), str(heads), str(hidden)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over the {timeout:.0f}s limit", "process_s": time.perf_counter() - start}
    if proc.returncode != 0 or not result.exists():
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] }",
                "process_s": time.perf_counter() - start}
    data: dict[str, Any] = json.loads(result.read_text())
    data["process_s"] = time.perf_counter() - start
    return data


def scaling(args: argparse.Namespace) -> dict[str, Any]:
    """The scaling table (see the module docstring)."""
    sizes = [int(x) for x in args.scaling.split(",") if x]
    out_dir = args.model_dir / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    models: list[dict[str, Any]] = []
    for n in sizes:
        path, layers = ensure_stack(args.model_dir, n, args.hidden)
        models.append({"label": f"stack L={layers}", "path": path, "heads": max(4, args.hidden // 64),
                       "hidden": args.hidden})
    for extra in args.model or []:
        models.append({"label": extra.name, "path": extra, "heads": args.model_heads, "hidden": args.model_hidden})
    tools = [t for t in args.tools.split(",") if t]
    rows = []
    for m in models:
        m["nodes"], m["bytes"] = node_count(m["path"]), file_bytes(m["path"])
        row: dict[str, Any] = {"model": m["label"], "path": str(m["path"]), "nodes": m["nodes"],
                               "bytes": m["bytes"], "tools": {}}
        for tool in tools:
            dst = out_dir / f"{m['path'].stem}.{tool}.onnx"
            r = run_scale_tool(tool, m["path"], dst, m["heads"], m["hidden"], args.timeout)
            row["tools"][tool] = r
            what = r.get("error") or (f"{r['seconds']:.2f}s (CPU {r['cpu_s']:.2f}s), "
                                      f"peak RSS {_fmt_mb(r['peak_rss'])} MB")
            print(f"  {m['label']:>14} ({m['nodes']} nodes) {tool:8s} {what}", flush=True)
        rows.append(row)

    print()
    print(f"cleanup,fuse + save (mograph) vs ONNX Runtime's transformers optimizer (ort), and inspect; "
          f"LLaMA-style stacks, hidden {args.hidden}; each run a fresh process")
    head = f"{'model':>18} {'nodes':>7} {'MB':>6}" + "".join(
        f" {t + ' s':>10} {t + ' cpu s':>12} {t + ' peakMB':>14} {'xbytes':>6}" for t in tools)
    print(head)
    print("-" * len(head))
    for row in rows:
        line = f"{row['model']:>18} {row['nodes']:>7} {_fmt_mb(row['bytes']):>6}"
        for t in tools:
            r = row["tools"][t]
            if "error" in r:
                line += f" {'-':>10} {'-':>12} {'-':>14} {'-':>6}"
                continue
            line += (f" {r['seconds']:>10.2f} {r['cpu_s']:>12.2f} {_fmt_mb(r['peak_rss']):>14} "
                     f"{r['peak_rss'] / max(row['bytes'], 1):>6.1f}")
        print(line)
    for row in rows:
        for t in tools:
            if "error" in row["tools"][t]:
                print(f"  {row['model']} {t}: {row['tools'][t]['error']}")
    stacks = [r for r in rows if r["model"].startswith("stack")]
    ten = min(stacks, key=lambda r: abs(r["nodes"] - 10_000), default=None)
    top = max(stacks, key=lambda r: r["nodes"], default=None)
    if ten is not None and top is not None and top is not ten:
        for t in tools:
            a, b = ten["tools"][t], top["tools"][t]
            if "error" not in a and "error" not in b:
                print(f"{t}: {top['nodes']} nodes take x{b['seconds'] / a['seconds']:.1f} the time "
                      f"(x{b['cpu_s'] / a['cpu_s']:.1f} the CPU time) of {ten['nodes']} "
                      f"(nodes x{top['nodes'] / ten['nodes']:.1f})")
    print("\nmograph per pass (CPU s):")
    for row in rows:
        r = row["tools"].get("mograph", {})
        per = r.get("pass_cpu") or r.get("passes")
        if per:
            total = sum(s for _, s in per)
            worst = max(per, key=lambda p: p[1])
            print(f"  {row['model']}: " + ", ".join(f"{n} {s:.2f}" for n, s in per))
            print(f"    largest pass: {worst[0]} {worst[1]:.2f}s = {100 * worst[1] / total:.0f}% of {total:.2f}s")
    result = {"hidden": args.hidden, "rows": rows}
    if args.markdown:
        args.markdown.write_text(scaling_markdown(result, tools, " ".join(sys.argv)))
        print(f"\nwrote {args.markdown}")
    return result


def scaling_markdown(result: dict[str, Any], tools: list[str], command: str) -> str:
    """The scaling table and the per-pass breakdown as markdown (``--markdown``)."""
    lines = [f"Command: `{command}`", "",
             "Seconds are wall time of the job in a fresh process (load, passes, output check, save; imports "
             "excluded); CPU is that process's own CPU time, which a loaded shared machine does not inflate.", ""]
    head = "| model | nodes | MB |" + "".join(f" {t} s | {t} CPU s | {t} peak MB | {t} peak/bytes |" for t in tools)
    lines += [head, "|" + "---|" * (3 + 4 * len(tools))]
    for row in result["rows"]:
        cells = [row["model"], str(row["nodes"]), _fmt_mb(row["bytes"])]
        for t in tools:
            r = row["tools"][t]
            if "error" in r:
                cells += [r["error"], "-", "-", "-"]
            else:
                cells += [f"{r['seconds']:.1f}", f"{r.get('cpu_s', float('nan')):.1f}", _fmt_mb(r["peak_rss"]),
                          f"{r['peak_rss'] / max(row['bytes'], 1):.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    stacks = [r for r in result["rows"] if r["model"].startswith("stack")]
    ten = min(stacks, key=lambda r: abs(r["nodes"] - 10_000), default=None)
    top = max(stacks, key=lambda r: r["nodes"], default=None)
    if ten is not None and top is not None and top is not ten:
        lines.append("")
        for t in tools:
            a, b = ten["tools"][t], top["tools"][t]
            if "error" not in a and "error" not in b:
                lines.append(f"- {t}: {top['nodes']} nodes take x{b['seconds'] / a['seconds']:.1f} the wall time and "
                             f"x{b['cpu_s'] / a['cpu_s']:.1f} the CPU time of {ten['nodes']} nodes "
                             f"(x{top['nodes'] / ten['nodes']:.1f} the nodes)")
    lines += ["", "Per pass (CPU seconds of each pass, measured by an instrument, and share of the passes' total):",
              ""]
    for row in result["rows"]:
        r = row["tools"].get("mograph", {})
        per = r.get("pass_cpu") or r.get("passes")
        if not per:
            continue
        total = sum(sec for _, sec in per) or 1.0
        worst = max(per, key=lambda p: p[1])
        lines.append(f"- {row['model']} ({row['nodes']} nodes): largest pass {worst[0]} {worst[1]:.2f}s = "
                     f"{100 * worst[1] / total:.0f}% of {total:.2f}s; "
                     + ", ".join(f"{n} {sec:.2f} ({100 * sec / total:.0f}%)" for n, sec in per))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ main


def _fmt_mb(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_worker":
        _tool_worker(*sys.argv[2:6], sys.argv[6] if len(sys.argv) > 6 else None)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--_scale_worker":
        _scale_worker(*sys.argv[2:8])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--_export":
        _export_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="12,48", help="comma-separated layer counts (default 12,48)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per tool and model (median reported)")
    ap.add_argument("--config", choices=("base", "export-hf"), default="base", help="BERT config (see above)")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/mograph-bench-core"), help="export cache")
    ap.add_argument("--profile", default="", help="comma-separated tools to profile once per model")
    ap.add_argument("--profile-top", type=int, default=20)
    ap.add_argument("--no-check", action="store_true", help="skip onnx.checker and the ONNX Runtime run")
    ap.add_argument("--json", type=Path, help="write all measurements to this file")
    ap.add_argument("--scaling", default=None, metavar="NODES",
                    help="scaling mode: comma-separated node counts of LLaMA-style stacks (see above)")
    ap.add_argument("--hidden", type=int, default=32, help="scaling mode: hidden width of the stacks")
    ap.add_argument("--tools", default=",".join(SCALE_TOOLS), help="scaling mode: tools to run")
    ap.add_argument("--timeout", type=float, default=600, help="scaling mode: seconds per run")
    ap.add_argument("--model", type=Path, action="append", help="scaling mode: also run this model")
    ap.add_argument("--markdown", type=Path, help="scaling mode: also write the table as markdown to this file")
    ap.add_argument("--model-heads", type=int, default=9, help="num_heads given to ort for --model")
    ap.add_argument("--model-hidden", type=int, default=576, help="hidden_size given to ort for --model")
    args = ap.parse_args()
    if args.scaling is not None:
        results = scaling(args)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2, default=str))
        return
    layers = [int(x) for x in args.layers.split(",") if x]
    profile_tools = [t for t in args.profile.split(",") if t]
    for t in profile_tools:
        if t not in TOOLS:
            ap.error(f"--profile takes {', '.join(TOOLS)}, not {t!r}")

    t_all = time.perf_counter()
    out_dir = args.model_dir / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    models: dict[int, dict[str, Any]] = {}
    for n in layers:
        path, export_s = ensure_model(args.model_dir, args.config, n)
        models[n] = {"path": path, "nodes": node_count(path), "bytes": file_bytes(path), "export_s": export_s}
        how = "cached" if export_s is None else f"exported in {export_s:.0f}s"
        print(f"model L={n}: {path} ({models[n]['nodes']} nodes, {_fmt_mb(models[n]['bytes'])} MB, {how})")

    runs: dict[tuple[int, str], list[dict[str, Any]]] = {(n, t): [] for n in layers for t in TOOLS}
    for rep in range(args.repeats):
        for n in layers:
            order = TOOLS if rep % 2 == 0 else TOOLS[::-1]
            for tool in order:
                dst = out_dir / f"L{n}.{tool}.onnx"
                r = run_tool(tool, models[n]["path"], dst)
                runs[(n, tool)].append(r)
                print(f"  rep {rep + 1}/{args.repeats} L={n} {tool:8s} {r['seconds']:7.2f}s "
                      f"(process {r['process_s']:.2f}s, peak RSS {_fmt_mb(r['peak_rss'])} MB)", flush=True)

    results: dict[str, Any] = {"config": args.config, "opset": OPSET, "repeats": args.repeats, "models": {}}
    for n in layers:
        m = models[n]
        entry: dict[str, Any] = {"nodes_in": m["nodes"], "bytes_in": m["bytes"], "tools": {}}
        ref = None if args.no_check else run_outputs(m["path"], feeds())
        for tool in TOOLS:
            rs = runs[(n, tool)]
            dst = out_dir / f"L{n}.{tool}.onnx"
            secs = [r["seconds"] for r in rs]
            med = statistics.median(secs)
            t: dict[str, Any] = {
                "seconds": secs,
                "median_s": med,
                "process_median_s": statistics.median(r["process_s"] for r in rs),
                "import_median_s": statistics.median(r["import_s"] for r in rs),
                "peak_rss_max": max(r["peak_rss"] for r in rs),
                "rss_after_import": statistics.median(r["rss_after_import"] for r in rs),
                "nodes_out": node_count(dst),
                "bytes_out": file_bytes(dst),
                "s_per_layer": med / n,
                "us_per_input_node": 1e6 * med / m["nodes"],
            }
            if "phases" in rs[0]:
                t["phases_median_s"] = {k: statistics.median(r["phases"][k] for r in rs) for k in rs[0]["phases"]}
            if ref is not None:
                t["checker_error"] = checker_error(dst)
                t["max_abs_diff"] = max_abs_diff(ref, run_outputs(dst, feeds()))
            entry["tools"][tool] = t
        entry["ratio_mograph_over_onnxslim"] = entry["tools"]["mograph"]["median_s"] / entry["tools"]["onnxslim"][
            "median_s"
        ]
        results["models"][n] = entry

    # ---- table
    print()
    print(f"load + cleanup + save, BERT ({args.config}) opset {OPSET}, median of {args.repeats} interleaved runs, "
          "each in a fresh process")
    head = (f"{'layers':>6} {'tool':8} {'nodes in':>8} {'nodes out':>9} {'median s':>9} {'min..max s':>13} "
            f"{'proc s':>7} {'s/layer':>8} {'us/node':>8} {'peak RSS MB':>11} {'out MB':>7} {'checker':>7} "
            f"{'max|diff|':>9}")
    print(head)
    print("-" * len(head))
    for n in layers:
        e = results["models"][n]
        for tool in TOOLS:
            t = e["tools"][tool]
            chk = "-" if "checker_error" not in t else ("ok" if t["checker_error"] is None else "FAIL")
            diff = f"{t['max_abs_diff']:.2e}" if "max_abs_diff" in t else "-"
            span = f"{min(t['seconds']):.2f}..{max(t['seconds']):.2f}"
            print(f"{n:>6} {tool:8} {e['nodes_in']:>8} {t['nodes_out']:>9} {t['median_s']:>9.2f} {span:>13} "
                  f"{t['process_median_s']:>7.2f} {t['s_per_layer']:>8.3f} {t['us_per_input_node']:>8.0f} "
                  f"{_fmt_mb(t['peak_rss_max']):>11} {_fmt_mb(t['bytes_out']):>7} {chk:>7} {diff:>9}")
    print()
    for n in layers:
        print(f"ratio mograph/onnxslim at {n} layers: {results['models'][n]['ratio_mograph_over_onnxslim']:.2f} "
              "(goal < 1)")
    if len(layers) >= 2:
        lo, hi = min(layers), max(layers)
        a, b = results["models"][lo], results["models"][hi]
        growth_nodes = b["nodes_in"] / a["nodes_in"]
        results["scaling"] = {}
        for tool in TOOLS:
            g = b["tools"][tool]["median_s"] / a["tools"][tool]["median_s"]
            results["scaling"][tool] = {"time_growth": g, "node_growth": growth_nodes}
            print(f"{tool}: time x{g:.2f} from {lo} to {hi} layers (nodes x{growth_nodes:.2f}, layers "
                  f"x{hi / lo:.2f}); s/layer {a['tools'][tool]['s_per_layer']:.3f} -> "
                  f"{b['tools'][tool]['s_per_layer']:.3f}, us/node {a['tools'][tool]['us_per_input_node']:.0f} -> "
                  f"{b['tools'][tool]['us_per_input_node']:.0f}")
    print()
    print("mograph phases (median s):")
    for n in layers:
        ph = results["models"][n]["tools"]["mograph"].get("phases_median_s", {})
        print(f"  L={n}: " + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()))
    for n in layers:
        for tool in TOOLS:
            err = results["models"][n]["tools"][tool].get("checker_error")
            if err:
                print(f"  checker on {tool} L={n}: {err}")

    if profile_tools:
        results["profiles"] = {}
        for n in layers:
            for tool in profile_tools:
                prof = out_dir / f"L{n}.{tool}.prof"
                r = run_tool(tool, models[n]["path"], out_dir / f"L{n}.{tool}.profiled.onnx", profile=prof)
                print(f"\nprofile of {tool} at L={n} (untimed run, {r['seconds']:.2f}s under cProfile):")
                results["profiles"][f"{tool}-L{n}"] = print_profile(prof, args.profile_top)

    results["bench_seconds"] = time.perf_counter() - t_all
    print(f"\nwhole benchmark: {results['bench_seconds']:.0f}s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
