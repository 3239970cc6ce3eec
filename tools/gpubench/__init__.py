"""GPU benchmark: mograph against ONNX Runtime's transformers optimizer, onnxscript's ORT fusions, and torch.

One grid, measured on one GPU, written as JSON lines as it goes (so it can be spread over several calls):

* **models** (random seeded weights, built from transformers configs; nothing is downloaded):
  ``bert`` (BERT-base: 12 layers, hidden 768, 12 heads, FFN 3072), ``gpt2`` (GPT-2 124M), ``llama``
  (LLaMA-style decoder: 12 layers, hidden 768, 12 query / 4 KV heads, rotary, SwiGLU 2048), ``vit``
  (ViT-B/16), ``whisper`` (a Whisper-style encoder: 12 layers, d_model 768, 80 mel bins);
* **exports**: ``torchscript`` (``torch.onnx.export(dynamo=False)``, opset 17) and ``dynamo``
  (``dynamo=True``, opset 18), each with transformers' ``eager`` and ``sdpa`` attention (``--attn``);
* **variants**, all float16 on the GPU, inputs and outputs float32:
  ``exported`` (the export through ``onnxruntime.transformers.float16.convert_float_to_float16
  (keep_io_types=True)``), ``ort-t`` (``onnxruntime.transformers.optimizer.optimize_model`` with the
  model's ``model_type``, then the same converter), ``onnxscript`` (``onnxscript.rewriter.ort_fusions.
  optimize_for_ort``, dynamo exports only, then the same converter), ``mograph`` (``cleanup,fuse`` lowered
  ``--target ort``, then mograph's own ``fp16`` pass calibrated on 4 seeded feeds), ``mograph-ortfp16``
  (the same fused float32 graph through ORT's converter instead: mograph's fp16 against ORT's on one graph,
  issue 15 item 4); and the references
  ``torch-eager`` (the model in float16 with sdpa attention) and ``torch-compile`` (the same through
  ``torch.compile``), on the same GPU (on CPU, ``--smoke``, torch runs float32 and torch.compile is skipped);
* **shapes**: ``BxS`` prefill cells (default 1, 8, 32 x 128, 512) and ``decode:BxP`` (one token with a
  KV cache of P, default P = 512) for the decoders.  ViT has no sequence input: S=128 runs 224x224
  images (197 tokens), S=512 384x384 (577 tokens), other S the nearest square patch grid.  The Whisper
  encoder is built with ``max_source_positions = S`` (2S mel frames).

Each cell's time is the median of single ``run_with_iobinding`` calls (inputs and outputs on the
device, bound once; the call returns when the GPU is done) after ``--warmup`` runs; the variants of a
cell are timed in interleaved rounds so that drift hits them alike.  Accuracy is the cosine (and max
abs) of the model's main output against the float32 torch model (eager attention) on the same feeds.
``ratio`` is mograph over the best ORT peer of the cell; ``vs_compile`` mograph over torch.compile.

Every ORT variant's first run is profiled (ONNX Runtime's profiler, read by ``mograph.backends.ort``): each row
records how many nodes ran off the device's provider (on the CPU, under CUDA) and how many Memcpy nodes ONNX
Runtime inserted, so "no Memcpy nodes added by mograph that the export did not have" is visible per cell.

``--kernels N`` also records, per cell and ORT variant, the CUDA kernels ``torch.profiler`` saw over N IO-bound
runs (total device ms a run, launches, the 25 heaviest by name), so a slow cell says which kernel it is.
``mograph-lengths`` (asked for by name only) is mograph with ``--mask-format lengths``: the 1-D key lengths
ORT's transformers optimizer also uses, exact only for right-padded masks.

Exports and optimized variants are kept in ``--cache`` (keyed by model, export, attention, graph), so a
later call only times; each built graph is loaded once by CPU ONNX Runtime before it is kept (a peer's
invalid rewrite fails its build, not a GPU call), and a graph's float32 intermediates are deleted once all
its variants are built (``--keep-intermediates``).  ``--list`` prints what is left and estimates the build
(spread over ``--jobs``) and timing seconds and the disk the cache needs.  A cell that fails is recorded with its error and the grid goes on; a cell whose
process died (a crash inside a runtime) is recorded as such on the next call, not retried.
``--time-budget`` stops starting new work after that many seconds, so one call can stay under a limit.

This package is ``tools/bench_gpu.py``'s implementation, one module per job: ``grid`` (the grid's
models, exports, variants, shapes), ``models`` (the transformers models and their feeds), ``cache`` (exports and
variants built once), ``runners`` (ONNX Runtime and torch runners, interleaved timing, kernels, cosine),
``results`` (the JSON-lines file), ``run`` (the grid run), ``tables`` (ratios and Markdown), ``estimate``
(``--list``) and ``cli``.

Usage (the H200, with onnxruntime-gpu installed there: ``import torch`` before ``onnxruntime`` so the CUDA
provider finds cuDNN/cuBLAS)::

    python tools/bench_gpu.py --out results.jsonl --cache /tmp/mograph-gpu --time-budget 480
    python tools/bench_gpu.py --out results.jsonl --models bert --exports torchscript --shapes 8x512
    python tools/bench_gpu.py --markdown BENCHMARKS-GPU.md --out results.jsonl
    python tools/bench_gpu.py --smoke --out /tmp/smoke.jsonl    # tiny models on CPU ONNX Runtime, ~2 min
    python tools/bench_gpu.py --smoke --models bert,gpt2,llama,vit,whisper --out /tmp/all.jsonl  # every cell, ~8 min

The sequence that fills the whole grid on the H200 is in BENCHMARKS-GPU.md ("How to run").
"""

from __future__ import annotations

from .cli import main

__all__ = ["main"]
