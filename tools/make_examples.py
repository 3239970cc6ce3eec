"""Regenerate the example models shipped in ``mograph/examples/`` from the seeded builders in ``models/``.

The shipped files are build products of code, not hand-edited blobs: this script writes them, byte for byte
the same on every run (fixed seeds, fixed names, a zip with fixed timestamps for the feeds), so a diff in
``git status`` after running it means the builders changed.

Written files:

- ``bert-tiny.onnx``: ``models.bert_tiny`` — 2 layers, hidden 64, 4 heads, FFN 128, vocab 100, opset 17,
  dynamic ``batch``/``seq``, with the pooler output; decomposed LayerNorm and Erf GELU as TorchScript
  exports them.
- ``cnn-small.onnx``: ``models.cnn_small`` — Conv/BN/Relu blocks with a residual Add, opset 17, dynamic
  batch, input ``image`` ``[batch, 3, 32, 32]``.
- ``bert-tiny.npz``, ``cnn-small.npz``: one batch of seeded feeds each, keyed by input name, so
  ``session.run(None, dict(np.load(path)))`` works.

Usage::

    python tools/make_examples.py            # write into mograph/examples/
    python tools/make_examples.py --check    # exit 1 if the shipped files differ from what would be written
    python tools/make_examples.py --out DIR  # write elsewhere
"""

from __future__ import annotations

import argparse
import io
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models.builders import bert_feeds, bert_tiny, cnn_small, random_feeds  # noqa: E402

EXAMPLES_DIR = ROOT / "mograph" / "examples"


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An ``.npz`` archive like ``np.savez`` writes, but reproducible: entries in the given order, each
    stamped 1980-01-01 (``np.savez`` stamps the current time, so its bytes change on every run)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            entry = io.BytesIO()
            np.lib.format.write_array(entry, np.ascontiguousarray(array), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            archive.writestr(info, entry.getvalue())
    return buf.getvalue()


def build_all() -> dict[str, bytes]:
    """File name -> bytes of every shipped example."""
    bert = bert_tiny(layers=2, hidden=64, heads=4, ffn=128, vocab=100, opset=17, dynamic=True, seed=0, pooler=True)
    cnn = cnn_small(opset=17, dynamic_batch=True, seed=0)
    return {
        "bert-tiny.onnx": bert.SerializeToString(deterministic=True),
        "bert-tiny.npz": npz_bytes(bert_feeds(batch=2, seq=16, vocab=100, seed=0)),
        "cnn-small.onnx": cnn.SerializeToString(deterministic=True),
        "cnn-small.npz": npz_bytes(random_feeds(cnn, {"batch": 2}, seed=0)),
    }


def main(argv: list[str] | None = None, echo: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=EXAMPLES_DIR, help="folder to write into")
    parser.add_argument("--check", action="store_true", help="compare with the files there instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for name, data in build_all().items():
        path = args.out / name
        if args.check:
            if not path.is_file() or path.read_bytes() != data:
                stale.append(name)
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        echo(f"wrote {path} ({len(data):,} bytes)")
    if stale:
        echo(f"out of date in {args.out}: {', '.join(stale)} (run tools/make_examples.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
