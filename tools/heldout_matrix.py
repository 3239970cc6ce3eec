"""Run every pass family on a folder of held-out models, as a user would, one CLI call per cell.

Usage: python tools/heldout_matrix.py MODELS_DIR OUT_DIR [--config cfg.json] [--only NAME,...] [--jobs N]

MODELS_DIR holds ``*.onnx``.  ``cfg.json`` maps a model's stem to ``{"shape": ["in:1x3x64x64", ...],
"feeds": "x.npz"}`` (the sizes of its dynamic dims; feeds for inputs that cannot be made at random, such
as strings).  Each cell runs ``mograph`` under ``timeout 300``, records exit code, wall time and the first
error line; each exit-0 output is loaded in ONNX Runtime (optimizations off) and run on the same seeded
feed as the original, giving the worst output's cosine and max-abs error over the output's peak.
Results go to ``OUT_DIR/results.jsonl`` (one line per cell) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

MOGRAPH = [sys.executable, "-m", "mograph"]


def cells(shapes: list[str], dynamic: bool, static_first: str | None) -> list[tuple[str, list[str], bool]]:
    """(name, argv after the model, writes a model) for every cell."""
    sh = [a for s in shapes for a in ("--shape", s)]
    out = [
        ("inspect", ["inspect"], False),
        ("validate", ["validate", *sh], False),
        ("bench", ["bench", "--warmup", "1", "--iterations", "3", *sh], False),
        ("cleanup", ["optimize", "--passes", "cleanup", "--verify", *sh], True),
        ("fuse", ["optimize", "--passes", "cleanup,fuse", "--verify", *sh], True),
        ("ort", ["optimize", "--passes", "cleanup,fuse", "--target", "ort", "--verify", *sh], True),
        ("trt", ["optimize", "--passes", "cleanup,fuse", "--target", "tensorrt", *sh], True),
        ("fp16", ["optimize", "--passes", "cleanup,fuse,fp16", "--calibration-random", "4", *sh], True),
        ("int8", ["optimize", "--passes", "cleanup,int8", "--calibration-random", "4", *sh], True),
        ("int4", ["optimize", "--passes", "cleanup,int4", *sh], True),
        ("fp8", ["optimize", "--passes", "cleanup,qdq-fp8", "--calibration-random", "4", *sh], True),
        ("prune", ["optimize", "--passes", "cleanup,prune", "--ratio", "0.3", "--scope", "all", *sh], True),
    ]
    if dynamic:
        out.append(("shapes", ["optimize", "--passes", "fix-shapes,cleanup", "--verify", *sh], True))
    elif static_first:
        out.append(
            ("shapes", ["optimize", "--passes", "make-dynamic,cleanup", "--dynamic", static_first, "--verify"], True)
        )
    return out


def first_error(text: str) -> str:
    for line in text.splitlines():
        low = line.lower()
        if "error" in low or "traceback" in low or "refus" in low or "cannot" in low or "failed" in low:
            return line.strip()[:300]
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1].strip()[:300] if lines else ""


def run_ort(path: str, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def compare(ref: list, got: list) -> tuple[float, float]:
    worst_cos, worst_rel = 1.0, 0.0
    for a, b in zip(ref, got):
        a = np.asarray(a)
        b = np.asarray(b)
        if a.dtype == object or a.dtype.kind in "USO":
            same = a.shape == b.shape and bool(np.all(a == b))
            worst_cos = min(worst_cos, 1.0 if same else 0.0)
            continue
        if a.shape != b.shape:
            return 0.0, float("inf")
        x = a.astype(np.float64).ravel()
        y = b.astype(np.float64).ravel()
        peak = max(float(np.max(np.abs(x))) if x.size else 0.0, 1e-12)
        worst_rel = max(worst_rel, float(np.max(np.abs(x - y))) / peak if x.size else 0.0)
        nx, ny = np.linalg.norm(x), np.linalg.norm(y)
        if nx < 1e-12 and ny < 1e-12:
            cos = 1.0
        elif nx < 1e-12 or ny < 1e-12:
            cos = 0.0
        else:
            cos = float(np.dot(x, y) / (nx * ny))
        worst_cos = min(worst_cos, cos)
    return worst_cos, worst_rel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models")
    ap.add_argument("out")
    ap.add_argument("--config")
    ap.add_argument("--only")
    ap.add_argument("--cells")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=300)
    args = ap.parse_args()
    cfg = json.loads(Path(args.config).read_text()) if args.config else {}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    models = sorted(Path(args.models).glob("*.onnx"))
    if args.only:
        keep = set(args.only.split(","))
        models = [m for m in models if m.stem in keep]

    import onnx

    from mograph.ir_io import load_model
    from mograph.validate._feeds import make_feeds

    jobs = []
    refs = {}
    for m in models:
        c = cfg.get(m.stem, {})
        shapes = c.get("shape", [])
        proto = onnx.load(str(m), load_external_data=False)
        inits = {i.name for i in proto.graph.initializer}
        ins = [i for i in proto.graph.input if i.name not in inits]
        dynamic = any(
            not d.HasField("dim_value") for i in ins for d in i.type.tensor_type.shape.dim
        )
        static_first = None
        if ins and ins[0].type.tensor_type.shape.dim:
            static_first = f"{ins[0].name}:0=batch"
        static_first = c.get("dynamic", static_first)
        feed_file = c.get("feeds")
        if feed_file:
            feeds = dict(np.load(feed_file, allow_pickle=True))
        else:
            sizes = {s.rsplit(":", 1)[0]: [int(x) for x in s.rsplit(":", 1)[1].split("x")] for s in shapes}
            feeds, _ = make_feeds(load_model(str(m)), shapes=sizes, seed=7)
        try:
            refs[m.stem] = (feeds, run_ort(str(m), feeds))
        except Exception as e:  # noqa: BLE001
            refs[m.stem] = (feeds, None)
            print(f"{m.stem}: original does not run in ORT: {e}", file=sys.stderr)
        extra = ["--feeds", feed_file] if feed_file else []
        for name, argv, writes in cells(shapes, dynamic, static_first):
            if args.cells and name not in args.cells.split(","):
                continue
            if feed_file and name not in ("inspect",):
                argv = [*argv, *extra]
            jobs.append((m, name, argv, writes))

    def run_one(job):
        m, name, argv, writes = job
        outp = out_dir / f"{m.stem}.{name}.onnx"
        cmd = ["nice", "-n", "10", "timeout", str(args.timeout), *MOGRAPH, argv[0], str(m), *argv[1:]]
        if writes:
            cmd += ["-o", str(outp)]
            if outp.exists():
                outp.unlink()
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True)
        dt = time.time() - t0
        rec = {"model": m.stem, "cell": name, "rc": p.returncode, "s": round(dt, 1),
               "err": first_error(p.stderr + p.stdout) if p.returncode else "", "cmd": " ".join(cmd[4:])}
        if writes and p.returncode == 0:
            feeds, ref = refs[m.stem]
            try:
                got = run_ort(str(outp), feeds)
                if ref is not None:
                    cos, rel = compare(ref, got)
                    rec["cos"] = round(cos, 6)
                    rec["rel"] = float(f"{rel:.3g}")
            except Exception as e:  # noqa: BLE001
                rec["ort_error"] = str(e).splitlines()[0][:300]
        (out_dir / f"{m.stem}.{name}.log").write_text(p.stdout + "\n---\n" + p.stderr)
        with open(out_dir / "results.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)
        return rec

    with ThreadPoolExecutor(args.jobs) as ex:
        list(ex.map(run_one, jobs))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
