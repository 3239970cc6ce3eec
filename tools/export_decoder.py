"""Export a LLaMA/Qwen2-style causal LM's prefill or decode graph the way optimum / GenAI users feed it.

    python tools/export_decoder.py --shape smollm2-135m --family llama --step decode --exporter torchscript -o d.onnx
    python tools/export_decoder.py --hf-dir HF_DIR --step prefill --exporter dynamo -o p.onnx

Inputs ``input_ids`` ``[B, S]``, ``attention_mask`` ``[B, P+S]`` (and for ``decode``
``past_key_values.i.key/value`` ``[B, G, P, D]``); outputs ``logits``, ``present.i.key/value``.  Random weights
(seeded) for ``--shape``; the folder's own weights for ``--hf-dir`` (local files only).  Then::

    mograph optimize d.onnx -o d.ort.onnx --passes cleanup,fuse,fp16 --target ort --fp16-io yes \\
        --calibration-data feeds.npz --mask-format lengths          # or --kv-cache shared
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import decoder_export as de  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", help="a local Hugging Face model folder (its config and weights)")
    p.add_argument("--shape", choices=["tiny", "smollm2-135m"], default="tiny", help="random-weight config shape")
    p.add_argument("--family", choices=list(de.FAMILIES), default="llama")
    p.add_argument("--layers", type=int, help="override the number of layers")
    p.add_argument("--step", choices=["prefill", "decode"], required=True)
    p.add_argument("--exporter", choices=["torchscript", "dynamo"], default="torchscript")
    p.add_argument("--feeds", help="also write seeded feeds (.npz) for --calibration-data")
    p.add_argument("--position-ids", action="store_true",
                   help="take position_ids [B, S] as the third input (as optimum's exports do)")
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args()
    if args.hf_dir:
        import transformers

        cfg = transformers.AutoConfig.from_pretrained(args.hf_dir, local_files_only=True)
        cfg._attn_implementation = "sdpa"
    else:
        sizes: dict[str, Any] = (dict(de.SMOLLM2_135M) if args.shape == "smollm2-135m"
                                 else {"hidden": 128, "heads": 4, "kv_heads": 2})
        if args.layers:
            sizes["layers"] = args.layers
        cfg = de.config(args.family, **sizes)
    de.export(cfg, args.step, args.exporter, args.output, hf_dir=args.hf_dir, position_ids=args.position_ids)
    if args.feeds:
        import numpy as np

        feeds: dict[str, Any] = de.feeds(cfg, args.step, batch=1, seq=1 if args.step == "decode" else 8, past=8,
                                         position_ids=args.position_ids)
        np.savez(args.feeds, **feeds)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
