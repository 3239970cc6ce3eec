"""Does ONNX Runtime's CUDA provider really capture what ``mograph inspect --device cuda`` predicts capturable?

For each ``--kv-cache shared`` decode step given (float16 I/O, as ``cleanup,fuse,fp16 --target ort --fp16-io yes
--kv-cache shared`` writes them), one step is run twice on the same feeds:

* ORT CPU (the reference), past and present in one buffer per layer (present bound to the past's buffer);
* ORT CUDA with ``enable_cuda_graph``: the session is refused when a node is not on the CUDA provider; else the
  step runs with IO binding on the device (first run captures, the second replays) and its logits are compared
  with the reference.

Feeds: batch 2, one new token, a buffer of 16 positions of which the first 8 hold a random past; the mask has
ones for the 9 valid positions; ``position_ids`` (where the graph takes it) is 8.  One JSON line per model::

    python tools/gpu_capture_check.py A.onnx B.onnx --out capture.jsonl            # on the GPU
    python tools/gpu_capture_check.py A.onnx --device cpu --out /tmp/c.jsonl       # CPU smoke (no capture)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

BATCH, PAST, BUFFER = 2, 8, 16
_NP = {1: np.float32, 10: np.float16, 7: np.int64, 6: np.int32}


def _feeds(sess: Any) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Inputs for one decode step, and which output shares which past buffer."""
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    for i in sess.get_inputs():
        dtype = {"tensor(float16)": np.float16, "tensor(float)": np.float32, "tensor(int64)": np.int64,
                 "tensor(int32)": np.int32}[i.type]
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, 100, (BATCH, 1)).astype(dtype)
        elif i.name == "attention_mask":
            mask = np.zeros((BATCH, BUFFER), dtype)
            mask[:, :PAST + 1] = 1
            feeds[i.name] = mask
        elif i.name == "position_ids":
            feeds[i.name] = np.full((BATCH, 1), PAST, dtype)
        elif len(i.shape) == 4:  # a past buffer [B, heads, max_sequence_length, head]
            buf = np.zeros((BATCH, int(i.shape[1]), BUFFER, int(i.shape[3])), dtype)
            buf[:, :, :PAST] = (rng.standard_normal(buf[:, :, :PAST].shape) * 0.5).astype(dtype)
            feeds[i.name] = buf
        else:
            raise SystemExit(f"gpu_capture_check: do not know how to feed {i.name} {i.shape}")
    outs = [o.name for o in sess.get_outputs()]
    pasts = [n for n in feeds if feeds[n].ndim == 4]
    presents = [o for o in outs if o != "logits"]
    if len(pasts) != len(presents):
        raise SystemExit("gpu_capture_check: past and present counts differ (not a shared-buffer step?)")
    return feeds, dict(zip(presents, pasts))


def check(path: Path, device: str) -> dict[str, Any]:
    import onnxruntime as ort

    row: dict[str, Any] = {"model": path.name}
    cpu = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds, share = _feeds(cpu)
    ref_bufs = {n: ort.OrtValue.ortvalue_from_numpy(v.copy()) for n, v in feeds.items()}
    binding = cpu.io_binding()
    for n, v in ref_bufs.items():
        binding.bind_ortvalue_input(n, v)
    binding.bind_output("logits")  # (first: get_outputs() keeps the binding order)
    for o, p in share.items():
        binding.bind_ortvalue_output(o, ref_bufs[p])
    cpu.run_with_iobinding(binding)
    ref = binding.get_outputs()[0].numpy()
    row["logits_shape"] = list(ref.shape)
    row["written_position_ok"] = bool(all(
        np.any(ref_bufs[p].numpy()[:, :, PAST] != 0) for p in share.values()))
    if device == "cpu":
        row["logits_finite"] = bool(np.isfinite(ref).all())
        return row
    opts = {"enable_cuda_graph": "1"}
    try:
        sess = ort.InferenceSession(str(path), providers=[("CUDAExecutionProvider", opts)])
    except Exception as exc:  # noqa: BLE001  (ORT refuses the capture at session creation)
        row.update(captured=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        return row
    bufs = {n: ort.OrtValue.ortvalue_from_numpy(v.copy(), "cuda", 0) for n, v in feeds.items()}
    logits = ort.OrtValue.ortvalue_from_shape_and_type(ref.shape, ref.dtype, "cuda", 0)
    binding = sess.io_binding()
    for n, v in bufs.items():
        binding.bind_ortvalue_input(n, v)
    for o, p in share.items():
        binding.bind_ortvalue_output(o, bufs[p])
    binding.bind_ortvalue_output("logits", logits)
    for _ in range(2):  # capture, then replay
        sess.run_with_iobinding(binding)
    got = logits.numpy()
    row.update(captured=True, logits_max_abs=float(np.max(np.abs(got.astype(np.float32) - ref.astype(np.float32)))),
               logits_scale=float(np.max(np.abs(ref.astype(np.float32)))))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default="capture.jsonl")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        import torch  # noqa: F401  (loads the CUDA libraries ONNX Runtime's provider needs: before onnxruntime)
    with open(args.out, "a") as out:
        for path in args.models:
            try:
                row = check(path, args.device)
            except Exception as exc:  # noqa: BLE001
                row = {"model": path.name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
