"""The tables: ratios per cell against the best peer and torch.compile, and the Markdown of BENCHMARKS-GPU.md."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from .grid import MODELS, OPTIONAL_VARIANTS, ORT_VARIANTS, PEERS, SHAPES, SMOKE_SHAPES

# -- tables ---------------------------------------------------------------------------------------------


def latest(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("status") in ("ok", "error") and "key" in r:
            out[r["key"]] = r
    return out


def _ms(r: dict[str, Any] | None) -> float | None:
    return r.get("median_ms") if r and r.get("status") == "ok" else None


#: Rows further apart than this are taken to come from different device leases (other machine, other noise).
LEASE_SECONDS = 45 * 60


def _same_lease(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two result rows were measured close enough in time to be compared (rows without a time: yes)."""
    if not a.get("time") or not b.get("time"):
        return True
    ta, tb = datetime.fromisoformat(a["time"]), datetime.fromisoformat(b["time"])
    return abs((ta - tb).total_seconds()) <= LEASE_SECONDS


def grid_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (model, export, attention, shape): each variant's ms, best peer, ratios, accuracy."""
    cells = latest(rows)
    groups: dict[tuple[str, str, str, str], dict[str, dict[str, Any]]] = {}
    torch_rows: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in cells.values():
        if r["export"] == "torch":
            torch_rows.setdefault((r["model"], r["shape"]), {})[r["variant"]] = r
        else:
            groups.setdefault((r["model"], r["export"], r["attn"], r["shape"]), {})[r["variant"]] = r
    order = {m: i for i, m in enumerate(MODELS)}
    shape_order = {s: i for i, s in enumerate(SHAPES + SMOKE_SHAPES)}
    out = []
    for (model, export, attn, shape), vs in sorted(
        groups.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1], kv[0][2], shape_order.get(kv[0][3], 99), kv[0][3])
    ):
        line: dict[str, Any] = {"model": model, "export": export, "attn": attn, "shape": shape}
        ref = vs.get("mograph")
        if ref is not None:  # several --out files: only rows of mograph's own lease are compared with it
            vs = {v: r for v, r in vs.items() if _same_lease(r, ref)}
            line["time"] = ref.get("time")
        for v in ORT_VARIANTS:
            line[v] = _ms(vs.get(v))
            if vs.get(v) and vs[v].get("status") == "error":
                line[v + "_error"] = vs[v]["error"]
            line[v + "_cosine"] = vs.get(v, {}).get("cosine")
            line[v + "_attention"] = (vs.get(v, {}).get("ops") or {}).get("attention")
            line[v + "_placement"] = vs.get(v, {}).get("placement")
            line[v + "_casts"] = (vs.get(v, {}).get("ops") or {}).get("Cast")
        fp16 = ((vs.get("mograph", {}).get("mograph_passes") or {}).get("fp16") or {}).get("fp16")
        if fp16:
            line["mograph_kept_fp32"] = {k.split(".", 1)[1]: n for k, n in fp16.items()
                                         if k.startswith("kept_fp32.") and n}
        for v, r in torch_rows.get((model, shape), {}).items():
            if ref is not None and not _same_lease(r, ref):
                continue
            line[v] = _ms(r)
            line[v + "_cosine"] = r.get("cosine")
        peers = {v: line[v] for v in PEERS if line.get(v) is not None}
        if peers:
            best = min(peers, key=lambda k: peers[k])
            line["best_peer"], line["best_peer_ms"] = best, peers[best]
            line["best_peer_fuses_attention"] = bool(line.get(best + "_attention"))
        if line.get("mograph") is not None and line.get("best_peer_ms"):
            line["ratio"] = line["mograph"] / line["best_peer_ms"]
        if line.get("mograph-lengths") is not None and line.get("best_peer_ms"):
            line["lengths_ratio"] = line["mograph-lengths"] / line["best_peer_ms"]
        if line.get("mograph") is not None and line.get("mograph-ortfp16"):
            line["fp16_ratio"] = line["mograph"] / line["mograph-ortfp16"]  # issue 15 item 4: <= 1 is the goal
        exported_memcpy = (line.get("exported_placement") or {}).get("memcpy")
        mograph_memcpy = (line.get("mograph_placement") or {}).get("memcpy")
        if exported_memcpy is not None and mograph_memcpy is not None:
            line["memcpy_added"] = max(0, mograph_memcpy - exported_memcpy)
        if line.get("mograph") is not None and line.get("torch-compile"):
            line["vs_compile"] = line["mograph"] / line["torch-compile"]
        out.append(line)
    return out


def _f(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _goal(line: dict[str, Any]) -> str:
    """Issue 15's goal for a cell: mograph within 3% of the best peer, 1.3x faster than it where it fuses
    no attention, and at 8x512 within 1.25x of torch.compile."""
    ratio = line.get("ratio")
    if ratio is None:
        return "-"
    need = 1 / 1.3 if not line.get("best_peer_fuses_attention") else 1.03
    if ratio > need:
        return "miss"
    if line.get("shape") == "8x512" and line.get("vs_compile") is not None and line["vs_compile"] > 1.25:
        return "miss (compile)"
    return "ok"


def _placements(line: dict[str, Any]) -> str:
    """``off/memcpy`` per ORT variant (``-`` where not measured), and a flag where mograph has more Memcpy
    nodes than the export (issue 15 item 3: mograph must add none)."""
    parts = []
    for v in ORT_VARIANTS:
        if v in OPTIONAL_VARIANTS:  # not a column of the tables
            continue
        p = line.get(v + "_placement")
        parts.append("-" if not p else f"{p['off_device']}/{p['memcpy']}")
    text = " · ".join(parts)
    if line.get("memcpy_added"):
        text += f" **(+{line['memcpy_added']} Memcpy)**"
    return text


def _fp16_cell(line: dict[str, Any]) -> str:
    """``kept (why) / Casts mograph · Casts ORT conv``: the nodes mograph's fp16 pass kept in float32 and why,
    and the Cast nodes of both fp16 conversions of the fused graph."""
    kept = line.get("mograph_kept_fp32")
    why = "-" if kept is None else (f"{sum(kept.values())} ({', '.join(f'{k} {n}' for k, n in kept.items())})"
                                    if kept else "0")
    return f"{why} / {_f(line.get('mograph_casts'), 'd')} · {_f(line.get('mograph-ortfp16_casts'), 'd')}"


def summary_table(rows: list[dict[str, Any]]) -> str:
    lines = grid_rows(rows)
    head = (f"{'model':<8} {'export':<11} {'attn':<5} {'shape':<13} {'exported':>9} {'ort-t':>9} {'onnxscr':>9} "
            f"{'mograph':>9} {'mg+ortf16':>9} {'best peer':>10} {'ratio':>6} {'fp16 r':>6} {'cos mograph':>11} "
            f"{'torch':>9} {'compile':>9} goal")
    out = [head]
    for ln in lines:
        out.append(
            f"{ln['model']:<8} {ln['export']:<11} {ln['attn']:<5} {ln['shape']:<13} {_f(ln.get('exported')):>9} "
            f"{_f(ln.get('ort-t')):>9} {_f(ln.get('onnxscript')):>9} {_f(ln.get('mograph')):>9} "
            f"{_f(ln.get('mograph-ortfp16')):>9} {ln.get('best_peer', '-'):>10} {_f(ln.get('ratio'), '.2f'):>6} "
            f"{_f(ln.get('fp16_ratio'), '.2f'):>6} {_f(ln.get('mograph_cosine'), '.5f'):>11} "
            f"{_f(ln.get('torch-eager')):>9} {_f(ln.get('torch-compile')):>9} {_goal(ln)}"
        )
    errors = [r for r in latest(rows).values() if r.get("status") == "error"]
    if errors:
        out.append(f"\n{len(errors)} cell(s) failed:")
        out += [f"  {r['key']}: {str(r.get('error'))[:160]}" for r in errors]
    return "\n".join(out)


#: In a --markdown target, the text above this line is kept (a hand-written "How to run", older runs).
KEEP_MARKER = "<!-- tools/bench_gpu.py --markdown replaces everything below this line; the text above is kept -->"


def write_markdown(path: Path, tables: str) -> None:
    """Write ``tables`` to ``path``; when ``path`` has :data:`KEEP_MARKER`, keep what is above it."""
    head = ""
    if path.exists():
        text = path.read_text()
        if KEEP_MARKER in text:
            head = text[: text.index(KEEP_MARKER)] + KEEP_MARKER + "\n\n"
            if tables.startswith("# "):  # the kept text has the title
                tables = tables.split("\n", 1)[1].lstrip("\n")
    path.write_text(head + tables)


def markdown(rows: list[dict[str, Any]], sources: list[str]) -> str:
    lines = grid_rows(rows)
    cells = list(latest(rows).values())
    commands = sorted({r.get("command") for r in cells if r.get("command")})
    gpus = sorted({str(r.get("gpu")) for r in cells if r.get("gpu")})
    versions: dict[str, set[str]] = {}
    for r in cells:
        for k, v in (r.get("versions") or {}).items():
            versions.setdefault(k, set()).add(str(v))
    smoke = any(r.get("smoke") for r in cells)
    md = ["# GPU benchmarks: mograph vs ONNX Runtime's transformers optimizer, onnxscript's ORT fusions, torch", ""]
    if smoke:
        md += ["**These rows come from `--smoke` (tiny random models on CPU ONNX Runtime): they test the script, "
               "they say nothing about GPU speed.**", ""]
    md += [f"Device: {', '.join(gpus) or 'unknown'}. Versions: "
           + ", ".join(f"{k} {'/'.join(sorted(v))}" for k, v in sorted(versions.items())) + ".", ""]
    md += ["Median ms of one `run_with_iobinding` call (inputs and outputs on the device), float16 (inputs and "
           "outputs float32), random seeded weights; variants of a cell timed in interleaved rounds in one process. "
           "`ratio` = mograph / best ORT peer (exported, ort-t, onnxscript) of the cell; `goal`: ratio <= 1.03, or "
           "<= 1/1.3 where the best peer fuses no attention, and at 8x512 `vs compile` <= 1.25; "
           "`vs compile` = mograph / torch.compile. `mograph + ORT fp16`: mograph's fused float32 graph through "
           "ORT's float16 converter (the same graph as `mograph`, the other fp16 conversion); `fp16: mograph / ORT conv` "
           "= mograph / that (issue 15 item 4 asks <= 1). Off-device / Memcpy nodes: from ONNX Runtime's profile of "
           "the first run, compute nodes that ran on another provider than the device's (under CUDA: on the CPU) and "
           "the Memcpy nodes ONNX Runtime inserted (it keeps small shape computations on the CPU on purpose: the Memcpy "
           "count is the one to watch); bold where mograph has more Memcpy nodes than the export. The last column: "
           "the nodes mograph's fp16 pass kept in float32 and the reasons it measured, and the Cast nodes of "
           "mograph's and ORT's fp16 conversions of the fused graph. "
           "Cosine: the main output against float32 torch (eager attention) on the same feeds. "
           "ViT has no sequence input: its S=128 cells run 224x224 images (197 tokens), S=512 384x384 (577 tokens); "
           "the Whisper-style encoder is built for S positions (2S mel frames). `decode:BxP`: one new token per "
           "sequence with a KV cache of P.", ""]
    md += ["Made with:", "", "```bash"] + commands + [f"python tools/bench_gpu.py --markdown BENCHMARKS-GPU.md "
                                                        f"--out {' --out '.join(sources)}", "```", ""]
    by_model: dict[str, list[dict[str, Any]]] = {}
    for ln in lines:
        by_model.setdefault(ln["model"], []).append(ln)
    for model, group in by_model.items():
        md += [f"## {model}", "",
               "| export | attn | shape | exported | ort-t | onnxscript | mograph | mograph + ORT fp16 | best peer | "
               "ratio | goal | fp16: mograph / ORT conv | cos mograph | cos best peer | cos mograph + ORT fp16 | "
               "torch eager | torch.compile | vs compile | attention ops (best peer / mograph) | "
               "off-device / Memcpy nodes (exported, ort-t, onnxscript, mograph, mograph + ORT fp16) | "
               "mograph fp16: kept fp32 (why) / Casts (mograph · ORT conv) |",
               "|---|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
        for ln in group:
            best = ln.get("best_peer")
            md.append(
                f"| {ln['export']} | {ln['attn']} | {ln['shape']} | {_f(ln.get('exported'))} | {_f(ln.get('ort-t'))} | "
                f"{_f(ln.get('onnxscript'))} | {_f(ln.get('mograph'))} | {_f(ln.get('mograph-ortfp16'))} | "
                f"{best or '-'} | {_f(ln.get('ratio'), '.2f')} | {_goal(ln)} | {_f(ln.get('fp16_ratio'), '.2f')} | "
                f"{_f(ln.get('mograph_cosine'), '.6f')} | {_f(ln.get(f'{best}_cosine') if best else None, '.6f')} | "
                f"{_f(ln.get('mograph-ortfp16_cosine'), '.6f')} | {_f(ln.get('torch-eager'))} | "
                f"{_f(ln.get('torch-compile'))} | {_f(ln.get('vs_compile'), '.2f')} | "
                f"{_f(ln.get(f'{best}_attention') if best else None, 'd')} / {_f(ln.get('mograph_attention'), 'd')} | "
                f"{_placements(ln)} | {_fp16_cell(ln)} |"
            )
        md.append("")
    notes = sorted({(r["key"].rsplit("/", 1)[0], r["note"]) for r in cells if r.get("note")})
    if notes:
        md += ["## Notes", "", "| graph / variant | note |", "|---|---|"]
        md += [f"| `{k}` | {n.replace('|', '/')[:300]} |" for k, n in notes]
        md.append("")
    errors = [r for r in cells if r.get("status") == "error"]
    if errors:
        md += ["## Cells that failed", "", "| cell | error |", "|---|---|"]
        md += [f"| `{r['key']}` | {str(r.get('error')).replace('|', '/')[:300]} |" for r in sorted(errors, key=lambda r: r["key"])]
        md.append("")
    return "\n".join(md)
