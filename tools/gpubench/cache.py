"""The cache: each graph exported once, each variant built from it once, checked to load, kept in ``--cache``."""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .grid import (
    ATTENTION_OPS,
    BUILT_FROM,
    COUNTED_OPS,
    INTERMEDIATES,
    OPSETS,
    OPTIONAL_VARIANTS,
    ORT_MODEL_TYPE,
    ORT_VARIANTS,
    Dims,
    applies,
    log,
)
from .models import dynamic_spec, hf_model, input_names, make_feeds, output_names, wrapper

# -- the cache: exports and variants --------------------------------------------------------------------


@dataclass
class Graph:
    model: str
    export: str
    attn: str
    kind: str
    folder: Path

    @property
    def name(self) -> str:
        return f"{self.model}/{self.export}/{self.attn}/{self.kind}"

    def path(self, variant: str) -> Path:
        return self.folder / f"{variant}.onnx"

    def status_path(self) -> Path:
        return self.folder / "status.json"

    def status(self) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(self.status_path().read_text())
        return {}

    def record(self, variant: str, entry: dict[str, Any]) -> None:
        status = self.status()
        status[variant] = entry
        tmp = self.status_path().with_suffix(".tmp")
        tmp.write_text(json.dumps(status, indent=1))
        os.replace(tmp, self.status_path())


def graph_for(cache: Path, smoke: bool, model: str, export: str, attn: str, kind: str) -> Graph:
    """The cached graph of one (model, export, attention, graph kind), in its own folder of ``cache``."""
    return Graph(model, export, attn, kind, cache / f"{'smoke-' if smoke else ''}{model}-{export}-{attn}-{kind}")


def weights_for(model: str, kind: str, dims: Dims, cache: Path, smoke: bool) -> dict[str, Any]:
    """The state dict of a (model, graph): made once and kept, so every export and torch run agree."""
    import torch

    path = cache / f"weights-{'smoke-' if smoke else ''}{model}-{kind}.pt"
    if path.exists():
        return torch.load(path, map_location="cpu", weights_only=True)
    state = hf_model(model, kind, "eager", dims).state_dict()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # --jobs: the eager and sdpa builds of a model race here
    torch.save(state, tmp)
    os.replace(tmp, path)  # the same seeded weights either way
    return state


def torch_module(model: str, kind: str, attn: str, dims: Dims, cache: Path, smoke: bool) -> Any:
    hf = hf_model(model, kind, attn, dims)
    hf.load_state_dict(weights_for(model, kind, dims, cache, smoke))
    return wrapper(model, kind, hf, dims.layers)


def export_graph(g: Graph, dims: Dims, cache: Path, smoke: bool) -> None:
    import torch

    module = torch_module(g.model, g.kind, g.attn, dims, cache, smoke)
    feeds = make_feeds(g.model, g.kind, 2, 16 if g.kind in ("prefill", "decode") else 0, dims, seed=123)
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    names = input_names(g.model, g.kind, dims.layers)
    outs = output_names(g.kind, dims.layers)
    axes, shapes = dynamic_spec(g.model, g.kind, dims.layers)
    tmp = g.folder / "export.tmp.onnx"
    with torch.no_grad():
        if g.export == "torchscript":
            torch.onnx.export(module, args, str(tmp), input_names=names, output_names=outs, dynamic_axes=axes,
                              opset_version=OPSETS["torchscript"], dynamo=False, do_constant_folding=True)
        else:
            torch.onnx.export(module, args, str(tmp), input_names=names, output_names=outs, dynamic_shapes=shapes,
                              opset_version=OPSETS["dynamo"], dynamo=True, external_data=False)
    os.replace(tmp, g.path("fp32"))


def _fp16_peer(src: Any) -> Any:
    """ONNX Runtime's float16 converter, inputs and outputs kept float32 (how the peers are made fp16)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(src, keep_io_types=True)


def op_counts(path: Path) -> dict[str, int]:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    ops = Counter(n.op_type for n in proto.graph.node)
    out = {k: ops[k] for k in COUNTED_OPS if ops[k]}
    out["attention"] = sum(ops[k] for k in ATTENTION_OPS)
    out["nodes"] = sum(ops.values())
    return out


def calibration_file(g: Graph, dims: Dims, smoke: bool) -> Path:
    """Four seeded feeds of batch 1 (stacked in one .npz) for mograph's fp16 pass."""
    path = g.folder / "calibration.npz"
    if not path.exists():
        seq = 16 if smoke else 128
        feeds = make_feeds(g.model, g.kind, 4, seq, dims, seed=7)
        np.savez(path, **feeds)
    return path


def prepare_variant(g: Graph, variant: str, dims: Dims, smoke: bool, gpu: bool = True) -> None:
    """Write ``variant.onnx`` (float16) from the export ``fp32.onnx`` (``gpu``: the ORT optimizer's ``use_gpu``)."""
    import onnx

    src, dst = g.path("fp32"), g.path(variant)
    tmp = g.folder / f"{variant}.tmp.onnx"
    if variant == "exported":
        onnx.save(_fp16_peer(onnx.load(str(src))), str(tmp))
    elif variant == "ort-t":
        from onnxruntime.transformers.optimizer import optimize_model

        model_type = ORT_MODEL_TYPE[g.model]
        try:
            opt = optimize_model(str(src), model_type=model_type, num_heads=dims.heads, hidden_size=dims.hidden,
                                 use_gpu=gpu)
        except Exception as exc:  # noqa: BLE001 - the peer's own recipe crashed on this export: try its generic one
            if model_type == "bert":
                raise
            # e.g. ORT 1.2x-1.31's gpt2 post-processing indexes a Gemm's bias that a dynamo export's Gemm lacks
            opt = optimize_model(str(src), model_type="bert", num_heads=dims.heads, hidden_size=dims.hidden,
                                 use_gpu=gpu)
            g.record("ort-t-note", {"note": f"model_type={model_type} failed ({describe(exc)}); built with "
                                            "model_type=bert"})
        onnx.save(_fp16_peer(opt.model), str(tmp))
    elif variant == "onnxscript":
        import onnx_ir as ir
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        model = ir.load(str(src))
        model, fusions = optimize_for_ort(model)
        g.record("onnxscript-fusions", {k: v for k, v in dict(fusions).items() if v})
        onnx.save(_fp16_peer(ir.serde.serialize_model(model)), str(tmp))
    elif variant == "fused":
        import mograph

        model, report = mograph.optimize(str(src), "cleanup,fuse", options={"target": "ort"})
        g.record("mograph-fuse", {p.name: p.stats for p in report.passes if p.modified})
        mograph.save(model, str(tmp), overwrite=True)
    elif variant == "fused-lengths":  # the same with --mask-format lengths (exact only for right padding)
        import mograph

        model, report = mograph.optimize(str(src), "cleanup,fuse", options={"target": "ort", "mask_format": "lengths"})
        g.record("mograph-lengths-fuse", {p.name: p.stats for p in report.passes if p.modified})
        mograph.save(model, str(tmp), overwrite=True)
    elif variant == "mograph-lengths":
        import mograph

        model, _ = mograph.optimize(str(g.path("fused-lengths")), "fp16",
                                    options={"calibration_data": str(calibration_file(g, dims, smoke))})
        mograph.save(model, str(tmp), overwrite=True)
    elif variant == "mograph":
        import mograph

        model, report16 = mograph.optimize(str(g.path("fused")), "fp16",
                                           options={"calibration_data": str(calibration_file(g, dims, smoke))})
        g.record("mograph-passes", {"fuse": g.status().get("mograph-fuse"),
                                    "fp16": {p.name: p.stats for p in report16.passes}})
        mograph.save(model, str(tmp), overwrite=True)
    elif variant == "mograph-ortfp16":
        onnx.save(_fp16_peer(onnx.load(str(g.path("fused")))), str(tmp))
    else:
        raise ValueError(variant)
    check_loads(tmp)
    os.replace(tmp, dst)


def check_loads(path: Path) -> None:
    """Fail the build (on the CPU, before the GPU sees it) when ONNX Runtime cannot load the graph: type or
    shape errors a peer's rewrite left (seen: onnxscript's ORT fusions on GPT-2 dynamo exports feed a rank-3
    tensor to a Gemm).  An op without a CPU kernel (a CUDA-only contrib op) is not an error here."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 4
    opts.intra_op_num_threads = 1
    try:
        ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - re-raised as one line, below
        if "Could not find an implementation" in str(exc):
            return
        raise RuntimeError(f"ONNX Runtime cannot load the {path.stem.removesuffix('.tmp')} graph: "
                           f"{str(exc).strip()[:300]}") from None


def needed_steps(g: Graph, variants: list[str]) -> list[str]:
    """The steps still to run for these variants: the missing ones and the graphs they are built from when
    those are not in the cache (an export dropped after its graph was complete is made again only if needed)."""
    missing = [v for v in dict.fromkeys(variants) if v in ORT_VARIANTS and not g.path(v).exists()]
    sources = list(dict.fromkeys(d for v in missing for d in BUILT_FROM.get(v, ()) if not g.path(d).exists()))
    raw = bool(sources) or any(not BUILT_FROM.get(v) for v in missing)
    return (["fp32"] if raw and not g.path("fp32").exists() else []) + sources + missing


def drop_intermediates(g: Graph, asked: list[str] | None = None) -> list[str]:
    """Delete the float32 export and mograph's fused float32 graphs once every variant of the graph is built
    (or failed): nothing times them, and the full grid's cache would not fit a 64 GiB disk with them.  "Every"
    is those ``asked`` for (a later call asking for another rebuilds what it needs), else the grid's variants."""
    status = g.status()
    wanted = set(asked) if asked else set(ORT_VARIANTS) - set(OPTIONAL_VARIANTS)
    variants = [v for v in ORT_VARIANTS if v in wanted and applies(g.model, g.export, g.attn, v)]
    if not all(g.path(v).exists() or (status.get(v) or {}).get("error") for v in variants):
        return []
    dropped = [s for s in INTERMEDIATES if g.path(s).exists()]
    for s in dropped:
        g.path(s).unlink()
    return dropped


def prepare(g: Graph, variants: list[str], dims: Dims, cache: Path, smoke: bool, retry: bool,
            deadline: float, gpu: bool = True, keep: bool = False) -> dict[str, str]:
    """Export (once) and build every variant asked for; return ``{variant: error}`` for those that failed.
    Unless ``keep``, the float32 intermediates go once the graph has all its variants (:func:`drop_intermediates`)."""
    g.folder.mkdir(parents=True, exist_ok=True)
    errors: dict[str, str] = {}
    status = g.status()
    for step in needed_steps(g, variants):
        if g.path(step).exists():
            continue
        if step in status and status[step].get("error") and not retry:
            errors[step] = status[step]["error"]
            continue
        if "fp32" in errors:
            errors[step] = f"export failed: {errors['fp32']}"
            continue
        failed_from = [d for d in BUILT_FROM.get(step, ()) if d in errors]
        if failed_from:
            errors[step] = f"{failed_from[0]} failed: {errors[failed_from[0]]}"
            continue
        if time.time() > deadline:
            errors[step] = "budget"
            continue
        t = time.perf_counter()
        log(f"{g.name}: {'exporting' if step == 'fp32' else 'building ' + step}")
        try:
            if step == "fp32":
                export_graph(g, dims, cache, smoke)
            else:
                prepare_variant(g, step, dims, smoke, gpu)
            g.record(step, {"seconds": round(time.perf_counter() - t, 1), "ops": op_counts(g.path(step))})
        except Exception as exc:  # noqa: BLE001 - a failing step is a result, recorded, and the grid goes on
            msg = describe(exc)
            log(f"{g.name}: {step} failed: {msg}")
            g.record(step, {"error": msg, "seconds": round(time.perf_counter() - t, 1),
                            "traceback": traceback.format_exc()[-3000:]})
            errors[step] = msg
    if not keep:
        drop_intermediates(g, variants)
    return errors


def describe(exc: BaseException) -> str:
    """One line for an error: its type and first line, and the first line of the exception that caused it
    (torch.onnx's export errors say only "step 1/3 failed"; the cause says why)."""
    parts = []
    seen = 0
    while exc is not None and seen < 4:
        text = str(exc).strip().splitlines()
        first = text[0][:300] if text else ""
        if not parts or first not in " ".join(parts):  # a cause that only repeats its wrapper adds nothing
            parts.append(f"{type(exc).__name__}: {first}")
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return " <- ".join(parts)[:700]
