"""Peak memory of every pass and command, over the model's weights (issue 25 item 3, issue 27 item 3).

Each job runs in a fresh Python subprocess (``python -m mograph ...`` through :func:`mograph.cli.main`), so
its peak is its own: the process's ``VmHWM`` (not ``ru_maxrss``, which Linux carries over from a parent
that once held a big model across ``fork``+``exec``).  A sampling thread reads the resident size every
20 ms and keeps the main thread's stack at the highest reading, so ``--where`` names the code that
held the peak (the sampled peak can miss a spike shorter than the interval; ``VmHWM`` does not).

Models:

* ``--synthetic GB`` (default 0.5): :func:`models.large.write_decoder` with about that many bytes of
  float32 weights in external data (embedding, attention, ReLU FFN, LM head; a decode step over a KV
  cache), its seeded feeds beside it.  Jobs: ``load`` (load and save, the floor), then
  ``optimize --passes P --calibration-data F --verify --feeds F`` for each pass of ``--passes``
  (default fp16,int8,qdq-fp8,int4,kv-cache-fp8,prune), then the commands ``bench`` and ``validate`` on
  the model and on its fp16 output (each over its own weights), and ``sweep`` of fp16 and int8.  Above 2 GB this is issue 25's model; below, every path is the same
  as above 2 GB as long as the weights pass :data:`mograph._spill.SPILL_BYTES` (256 MiB), except that
  the output check also loads the model in ONNX Runtime below :data:`mograph.output_check.ORT_MAX_BYTES`.
* ``--model FILE`` (repeatable): an existing model; jobs ``load`` and ``optimize --passes cleanup,fuse``
  (``--model-passes`` changes it).  ``--llama DIR`` first exports issue 27's 30-layer LLaMA (TorchScript,
  opset 17, LlamaConfig: hidden 576, 9/3 heads, FFN 1536, vocab 49152, random weights, weights inside
  the protobuf: 652 MB) into DIR, unless it is there, and adds it.

The table: job, exit status, seconds, peak RSS, peak over the weights' bytes, and the same less the
floor every job pays (a process that imports mograph, onnx and onnxruntime: ~150 MB), which is what a
model far above 2 GB shows; ``peak/w32``: the peak over the weights as ONNX Runtime's CPU provider holds
them, float16 ones widened to float32 (bench and validate of the fp16 output: the CPU provider has no
float16 MatMul kernels and widens every weight when the session is made, so twice the fp16 file's
weights is the least any process running it on the CPU holds).  ``--json FILE`` keeps
every number.

Run:  python tools/bench_memory.py --synthetic 0.5 --where
      python tools/bench_memory.py --synthetic 0 --llama /tmp/llama30 --where
Needs: onnxruntime (and torch + transformers for ``--llama``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PASSES = "fp16,int8,qdq-fp8,int4,kv-cache-fp8,prune"

_WORKER = r"""
import os, sys, threading, time, traceback, json
state = {"peak": 0, "stack": "", "trace": [], "last": 0}
step = int(os.environ.get("MOGRAPH_MEMORY_TRACE_MB", "0")) << 20
main_id = threading.get_ident()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def sample():
    # A frame object kept past its function's return keeps that function's locals alive (a model copy a
    # pass has dropped): every frame reference is let go at once, or the tool would measure itself.
    while True:
        now = rss()
        if step and abs(now - state["last"]) >= step:
            frame = sys._current_frames().get(main_id)
            where = [f"{fs.filename.split('/')[-1]}:{fs.lineno}:{fs.name}" for fs in traceback.extract_stack(frame)
                     if "mograph" in fs.filename or "passes" in fs.filename][-3:] if frame is not None else []
            frame = None
            state["trace"].append([now >> 20, " < ".join(reversed(where))])
            state["last"] = now
        if now > state["peak"]:
            frame = sys._current_frames().get(main_id)
            state["peak"] = now
            if frame is not None:
                lines = traceback.format_stack(frame)
                frame = None
                state["stack"] = "".join(l for l in lines if "mograph" in l or "passes" in l)[-3000:]
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
from mograph.cli import main
if sys.argv[2:] == ["--imports-only"]:
    import onnxruntime, onnx, numpy, mograph.api  # noqa: the floor every job pays
    sys.argv[2:] = ["--version"]
code = 1
try:
    code = main(sys.argv[2:])
finally:
    hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
    with open(sys.argv[1], "w") as f:
        json.dump({"peak_rss": hwm, "sampled_peak": state["peak"], "stack": state["stack"], "trace": state["trace"]},
              f)
sys.exit(code)
"""


def run_job(args: list[str], result: Path, timeout: float) -> dict[str, Any]:
    """``mograph ARGS`` in a fresh subprocess; its exit status, seconds and peaks."""
    result.unlink(missing_ok=True)
    start = time.perf_counter()
    try:
        # run from the work folder: mograph is the installed one (or PYTHONPATH's), not this checkout's by accident
        proc = subprocess.run([sys.executable, "-c", _WORKER, str(result), *args], cwd=result.parent,
                              capture_output=True, text=True, timeout=timeout)
        code, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired:
        code, err = "timeout", ""
    out: dict[str, Any] = {"exit": code, "seconds": time.perf_counter() - start}
    if result.exists():
        out.update(json.loads(result.read_text()))
    if code != 0:
        out["error"] = err.strip().splitlines()[-1] if err.strip() else ""
    return out


def weights_bytes(path: Path, half_as_float: bool = False) -> int:
    """Bytes of the model's initializers (external or not), without reading their data; with
    ``half_as_float``, float16 and bfloat16 ones counted as float32 (what ONNX Runtime's CPU provider holds:
    it has no float16 MatMul kernels and widens every such weight once, when the session is made)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    half = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    total = 0
    for t in proto.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        size = 4 if half_as_float and t.data_type in half else onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        total += n * size
    return total


def synthetic(folder: Path, gigabytes: float) -> tuple[Path, Path]:
    """A decoder of about ``gigabytes`` of float32 weights and its feeds (kept when already there)."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from models.large import decoder_bytes, decoder_feeds, write_decoder

    # hidden 1024, FFN 4096, heads 16; layers and vocabulary scaled to the size (embedding + head ~ 40%)
    hidden, ffn, heads = 1024, 4096, 16
    target = gigabytes * 1e9
    vocab = max(1024, int(0.4 * target / (8 * hidden)) // 256 * 256)
    layers = max(1, round((target - 8 * vocab * hidden) / (4 * (4 * hidden * hidden + 2 * hidden * ffn))))
    sizes = dict(hidden=hidden, ffn=ffn, vocab=vocab, layers=layers)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"decoder_{decoder_bytes(**sizes)}.onnx"
    feeds = path.with_suffix(".npz")
    if not path.exists():
        write_decoder(folder, heads=heads, name=path.name, **sizes)
        np.savez(feeds, **decoder_feeds(heads=heads, **sizes))
    return path, feeds


def llama(folder: Path) -> Path:
    """Issue 27's 30-layer LLaMA, exported by TorchScript with its weights inside the protobuf."""
    path = folder / "llama30_ts.onnx"
    if path.exists():
        return path
    import torch
    import transformers as T

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                        tie_word_embeddings=False, attn_implementation="eager")
    model = T.LlamaForCausalLM(cfg).eval()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    ids = torch.randint(0, 49152, (2, 8))
    with torch.no_grad():
        torch.onnx.export(Logits().eval(), (ids, torch.ones(2, 8, dtype=torch.int64)), str(path),
                          input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"},
                                        "logits": {0: "b", 1: "s"}}, opset_version=17, dynamo=False)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--synthetic", type=float, default=0.5, help="GB of float32 weights of the synthetic model (0: none)")
    ap.add_argument("--passes", default=PASSES, help="passes run one at a time on the synthetic model")
    ap.add_argument("--no-commands", action="store_true", help="skip bench, validate and sweep")
    ap.add_argument("--model", action="append", default=[], type=Path, help="an existing model (repeatable)")
    ap.add_argument("--model-passes", default="cleanup,fuse", help="pipeline run on --model (default cleanup,fuse)")
    ap.add_argument("--llama", type=Path, help="export (once) issue 27's 30-layer LLaMA into this folder and add it")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mograph-bench-memory"), help="work folder")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    ap.add_argument("--where", action="store_true", help="print the stack that held each job's sampled peak")
    ap.add_argument("--trace", type=int, default=0, metavar="MB",
                    help="log the resident size and the code running at each change of MB or more")
    ap.add_argument("--json", type=Path, help="write every number here")
    args = ap.parse_args(argv)
    if args.trace:
        os.environ["MOGRAPH_MEMORY_TRACE_MB"] = str(args.trace)
    work = args.dir
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []

    def job(model: Path, weights: int, name: str, cli: list[str], runs_as: int | None = None) -> None:
        print(f"... {model.name}: {name}", file=sys.stderr, flush=True)
        r = run_job(cli, work / "result.json", args.timeout)
        runs_as = runs_as or weights
        r.update(model=model.name, weights=weights, job=name, ratio=r.get("peak_rss", 0) / weights,
                 over_floor=(r.get("peak_rss", 0) - floor) / weights, runs_as=runs_as,
                 ratio_runs_as=r.get("peak_rss", 0) / runs_as)
        rows.append(r)
        print(f"    exit {r['exit']}, {r['seconds']:.0f} s, peak {r.get('peak_rss', 0) / 2**20:.0f} MiB = "
              f"{r['ratio']:.2f}x {r.get('error', '')}", file=sys.stderr, flush=True)
        for mib, where in r.get("trace", []):
            print(f"    {mib:>6} MiB  {where}", file=sys.stderr)
        if args.where and r.get("stack"):
            print("    at the sampled peak:\n" + "".join("      " + ln + "\n" for ln in r["stack"].splitlines()),
                  file=sys.stderr, flush=True)

    floor = run_job(["--imports-only"], work / "result.json", args.timeout).get("peak_rss", 0)
    print(f"imports (mograph, onnx, onnxruntime): peak {floor / 2**20:.0f} MiB", file=sys.stderr)

    if args.synthetic > 0:
        path, feeds = synthetic(work, args.synthetic)
        weights = weights_bytes(path)
        out = work / "out"
        out.mkdir(exist_ok=True)
        job(path, weights, "load+save", ["optimize", str(path), "-o", str(out / "load.onnx"), "--passes",
                                         "eliminate-dead"])
        fp16 = None
        for name in [p for p in args.passes.split(",") if p]:
            dst = out / f"{name}.onnx"
            job(path, weights, name, ["optimize", str(path), "-o", str(dst), "--passes", name,
                                      "--calibration-data", str(feeds), "--verify", "--feeds", str(feeds)])
            if name == "fp16" and rows[-1]["exit"] == 0:
                fp16 = dst
        if not args.no_commands:
            for target in [path] + ([fp16] if fp16 else []):
                w = weights_bytes(target)  # a command holds the model it is given: its own weights
                w32 = weights_bytes(target, half_as_float=True)  # and ORT's CPU provider runs them widened
                job(target, w, "bench", ["bench", str(target), "--feeds", str(feeds), "--iterations", "3",
                                         "--warmup", "1"], w32)
                job(target, w, "validate", ["validate", str(target), "--backend", "ort", "--feeds", str(feeds)],
                    w32)
            config = work / "sweep.yaml"
            config.write_text("configurations:\n  - name: fp16\n    passes: [fp16]\n  - name: int8\n    passes: [int8]\n"
                              "eval_samples: 1\nwarmup: 1\niterations: 2\n")
            (work / "runs.db").unlink(missing_ok=True)
            job(path, weights, "sweep fp16,int8", ["sweep", str(path), "--config", str(config), "--ledger",
                                                   str(work / "runs.db"), "--calibration-data", str(feeds),
                                                   "--eval-data", str(feeds)])
    models = list(args.model)
    if args.llama is not None:
        models.append(llama(args.llama))
    for path in models:
        weights = weights_bytes(path)
        dst = work / f"{path.stem}.opt.onnx"
        job(path, weights, "load+save", ["optimize", str(path), "-o", str(dst), "--passes", "eliminate-dead"])
        job(path, weights, args.model_passes, ["optimize", str(path), "-o", str(dst), "--passes", args.model_passes])

    print(f"\nimports floor {floor / 1e6:.0f} MB; (peak-floor)/w: what the model costs above it")
    print("peak/w32: over the weights as ONNX Runtime's CPU provider holds them (float16 widened to float32)")
    print(f"{'model':<28} {'job':<22} {'exit':>5} {'s':>6} {'weights MB':>10} {'peak MB':>8} {'peak/w':>7} "
          f"{'(peak-floor)/w':>14} {'peak/w32':>8}")
    for r in rows:
        print(f"{r['model'][:28]:<28} {r['job'][:22]:<22} {r['exit']!s:>5} {r['seconds']:>6.0f} "
              f"{r['weights'] / 1e6:>10.0f} {r.get('peak_rss', 0) / 1e6:>8.0f} {r['ratio']:>7.2f} "
              f"{r['over_floor']:>14.2f} {r['ratio_runs_as']:>8.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
