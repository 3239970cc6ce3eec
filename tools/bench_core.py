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


# ------------------------------------------------------------------------------------------ main


def _fmt_mb(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_worker":
        _tool_worker(*sys.argv[2:6], sys.argv[6] if len(sys.argv) > 6 else None)
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
    args = ap.parse_args()
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
