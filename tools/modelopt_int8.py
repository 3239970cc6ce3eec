"""Run NVIDIA ModelOpt's ONNX INT8 quantization on one model (called by tools/bench_int8.py).

ModelOpt (``nvidia-modelopt[onnx]``) pulls in onnxruntime-gpu, CuPy and a CUDA build of torch, which would
replace this project's onnxruntime and its pinned torch; it therefore lives in a venv of its own, made by
``tools/make_modelopt_venv.sh`` (``.venv-modelopt``), and this script runs there, in a separate process.
It reads the calibration feeds from a folder of ``.npz`` files (one feed each, in name order), calibrates
on the CPU execution provider, keeps float32 where it does not quantize (``high_precision_dtype=fp32``)
and writes the quantized model.

Run: ``.venv-modelopt/bin/python tools/modelopt_int8.py FP32.onnx CALIB_DIR OUT.onnx [--method max|entropy]
[--matmul-only]``
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("calib_dir")
    ap.add_argument("out")
    ap.add_argument("--method", default="max", choices=("max", "entropy"))
    ap.add_argument("--matmul-only", action="store_true", help="op_types_to_quantize=['MatMul']")
    args = ap.parse_args(argv)
    from modelopt.onnx.quantization import quantize
    from onnxruntime.quantization import CalibrationDataReader

    files = sorted(Path(args.calib_dir).glob("*.npz"))

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.rewind()

        def get_next(self):  # type: ignore[no-untyped-def]
            f = next(self.it, None)
            if f is None:
                return None
            with np.load(f) as z:
                return {k: z[k] for k in z.files}

        def get_first(self):  # type: ignore[no-untyped-def]
            with np.load(files[0]) as z:
                return {k: z[k] for k in z.files}

        def rewind(self) -> None:
            self.it = iter(files)

    # ModelOpt writes intermediate models next to its input (and may rewrite it): give it a copy
    work = Path(args.out).parent / "modelopt_work"
    work.mkdir(parents=True, exist_ok=True)
    model = work / Path(args.model).name
    shutil.copyfile(args.model, model)
    quantize(
        str(model),
        quantize_mode="int8",
        calibration_method=args.method,
        calibration_data_reader=Reader(),
        calibration_eps=["cpu"],
        high_precision_dtype="fp32",
        op_types_to_quantize=["MatMul"] if args.matmul_only else None,
        output_path=args.out,
        log_level="WARNING",
    )
    print(f"modelopt int8 ({args.method}): wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
