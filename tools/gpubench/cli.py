"""The command line of ``tools/bench_gpu.py``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from .estimate import list_pending
from .grid import ATTNS, EXPORTS, MODELS, OPTIONAL_VARIANTS, SHAPES, SMOKE_SHAPES, VARIANTS, Shape
from .results import read_results
from .run import run_grid
from .tables import latest, markdown, write_markdown

# -- command line ---------------------------------------------------------------------------------------


def _csv(choices: tuple[str, ...] | None) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if choices is not None:
            bad = [t for t in items if t not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; choose from {', '.join(choices)}")
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    from . import __doc__ as doc

    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Grid: models x exports x attention x variants x shapes; see tools/gpubench/__init__.py.")
    ap.add_argument("--out", action="append", metavar="FILE.jsonl",
                    help="results, one JSON line per cell, appended as they finish; cells already there are skipped "
                    "(with --markdown: the files to read, repeatable)")
    ap.add_argument("--cache", default="/tmp/mograph-gpu-cache", metavar="DIR",
                    help="exports and optimized variants, reused by later calls (default /tmp/mograph-gpu-cache)")
    ap.add_argument("--models", type=_csv(MODELS), help=f"subset of {','.join(MODELS)} (default: all)")
    ap.add_argument("--exports", type=_csv(EXPORTS), help=f"subset of {','.join(EXPORTS)} (default: both)")
    ap.add_argument("--attn", type=_csv(ATTNS), help="transformers attention: eager,sdpa (default: both)")
    ap.add_argument("--variants", type=_csv(VARIANTS), default=[v for v in VARIANTS if v not in OPTIONAL_VARIANTS],
                    help=f"subset of {','.join(VARIANTS)} (default: all but {','.join(OPTIONAL_VARIANTS)})")
    ap.add_argument("--shapes", type=_csv(None), default=None,
                    help=f"cells: BxS prefill, decode:BxP one token with a cache of P (default {','.join(SHAPES)})")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where to run (default cuda)")
    ap.add_argument("--time-budget", type=float, default=0, metavar="SECONDS",
                    help="start no new export or cell after this many seconds (0: no limit)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed runs per variant and cell (default 10)")
    ap.add_argument("--min-time", type=float, default=1.0, metavar="SECONDS",
                    help="timed seconds per variant and cell, over all rounds (default 1.0)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--max-iters", type=int, default=2000, help="most timed runs per variant and cell")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for ONNX Runtime and torch (0: default)")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="build the exports and variants the grid needs in N processes first (CPU-bound, mostly one "
                    "thread each: e.g. 12 on the 16-core H200 host, up to ~8 GB of memory each), then time them one by one")
    ap.add_argument("--prepare-only", action="store_true",
                    help="only export and build (fills --cache; in N processes with --jobs N), time nothing")
    ap.add_argument("--keep-intermediates", action="store_true",
                    help="keep each graph's float32 export and mograph's fused float32 graph in --cache after all its "
                    "variants are built (default: deleted then; the full grid's cache is ~40 GB without them)")
    ap.add_argument("--kernels", type=int, default=0, metavar="RUNS",
                    help="after timing, profile RUNS runs of each ORT variant with torch.profiler (CUDA only) and record "
                    "the kernels it launched in the cell's row (\"kernels\": total device ms a run, launches, the top 25)")
    ap.add_argument("--retry-errors", action="store_true", help="run again the cells and builds that failed before")
    ap.add_argument("--compile-on-cpu", action="store_true", help="time torch.compile on CPU too (slow to compile)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny random models (2 layers, hidden 64) on CPU ONNX Runtime, shapes 1x16,2x32,decode:2x16, "
                    "few iterations, no torch.compile: checks the script end to end in under two minutes; unless "
                    "--models/--exports/--attn are given it runs bert dynamo/sdpa, bert torchscript/eager and gpt2 "
                    "torchscript/sdpa")
    ap.add_argument("--list", action="store_true", help="print what the selection still has to build and time, with estimated build (at --jobs), timing "
                    "and disk, and exit")
    ap.add_argument("--verbose", action="store_true", help="keep the exporters' and libraries' warnings")
    ap.add_argument("--markdown", metavar="FILE.md", help="write the tables of the --out files as Markdown and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.out:
        raise SystemExit("bench_gpu: --out FILE.jsonl is required")
    if args.markdown:
        rows = [r for path in args.out for r in read_results(Path(path))]
        if not rows:
            raise SystemExit(f"bench_gpu: no results in {', '.join(args.out)}")
        write_markdown(Path(args.markdown), markdown(rows, args.out))
        sys.stdout.write(f"wrote {args.markdown} ({len(latest(rows))} cells)\n")
        return 0
    if len(args.out) != 1:
        raise SystemExit("bench_gpu: one --out file when running the grid")
    args.out = args.out[0]
    if args.shapes is None:
        args.shapes = list(SMOKE_SHAPES if args.smoke else SHAPES)
    args.smoke_grid = args.smoke and args.models is None and args.exports is None and args.attn is None
    args.models = args.models or list(MODELS)
    args.exports = args.exports or list(EXPORTS)
    args.attn = args.attn or list(ATTNS)
    if args.smoke:
        args.warmup = min(args.warmup, 2)
        args.min_time = min(args.min_time, 0.05)
        args.rounds = min(args.rounds, 2)
        if args.cache == "/tmp/mograph-gpu-cache":
            args.cache = "/tmp/mograph-gpu-cache-smoke"
    for s in args.shapes:
        Shape.parse(s)
    if args.list:
        return list_pending(args)
    return run_grid(args)


#: Rough seconds to build one cached graph of a full-size BERT-base-sized model in one ``--jobs`` worker, used by
#: ``--list`` until the cache holds measured times: measured on a shared 2-core host (BERT-base, one process per
#: step; see BENCHMARKS-GPU.md "How to run") and divided by 2.5 for the contention there. Once some graphs are
#: built, the median measured time of each (export, step) in --cache replaces these (scaled by MODEL_SCALE).
