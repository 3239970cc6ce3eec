"""``tools/bench_gpu.py``: the grid's bookkeeping (shapes, resume, crashed cells, ratios, Markdown) and one
tiny cell end to end on CPU ONNX Runtime (``--smoke``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "bench_gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module
    spec.loader.exec_module(module)
    return module


def test_shapes_and_graph_kinds(bench):
    s = bench.Shape.parse("decode:8x512")
    assert (s.batch, s.seq, s.decode) == (8, 512, True)
    assert bench.graph_kind("bert", s, bench.FULL) is None  # no decode step for an encoder
    assert bench.graph_kind("gpt2", s, bench.FULL) == "decode"
    p = bench.Shape.parse("32x512")
    assert bench.graph_kind("vit", p, bench.FULL) == "img384"
    assert bench.graph_kind("vit", bench.Shape.parse("1x128"), bench.FULL) == "img224"
    assert bench.graph_kind("whisper", p, bench.FULL) == "pos512"
    assert bench.applies("bert", "torchscript", "eager", "onnxscript") is False
    with pytest.raises(SystemExit, match="bad shape"):
        bench.Shape.parse("8by512")
    feeds = bench.make_feeds("llama", "decode", 2, 16, bench.SMOKE, seed=0)
    assert feeds["attention_mask"].shape == (2, 17) and feeds["past_1_value"].shape == (2, 2, 16, 16)


def _row(bench, variant, ms, export="torchscript", attn="eager", shape="8x512", attention=0, status="ok"):
    e, a = ("torch", "sdpa") if variant in bench.TORCH_VARIANTS else (export, attn)
    row = {"key": bench.cell_key("bert", e, a, variant, shape), "model": "bert", "export": e, "attn": a,
           "variant": variant, "shape": shape, "status": status, "ops": {"attention": attention}}
    if status == "ok":
        row.update(median_ms=ms, cosine=0.9999)
    else:
        row["error"] = "boom"
    return row


def test_ratios_goal_and_markdown(bench):
    rows = [_row(bench, "exported", 4.6), _row(bench, "ort-t", 2.0, attention=12),
            _row(bench, "mograph", 2.2, attention=12), _row(bench, "torch-compile", 1.6),
            _row(bench, "torch-eager", 3.0),
            # a second attention flavour: the best peer fuses no attention, so mograph must be 1.3x faster
            _row(bench, "exported", 3.0, attn="sdpa"), _row(bench, "ort-t", 2.6, attn="sdpa"),
            _row(bench, "mograph", 2.1, attn="sdpa", attention=12),
            _row(bench, "mograph", None, shape="1x128", status="error")]
    lines = {(ln["attn"], ln["shape"]): ln for ln in bench.grid_rows(rows)}
    eager = lines[("eager", "8x512")]
    assert eager["best_peer"] == "ort-t" and eager["ratio"] == pytest.approx(1.1)
    assert eager["vs_compile"] == pytest.approx(2.2 / 1.6) and bench._goal(eager) == "miss"
    sdpa = lines[("sdpa", "8x512")]
    assert sdpa["best_peer"] == "ort-t" and not sdpa["best_peer_fuses_attention"]
    assert bench._goal(sdpa) == "miss"  # 2.1 / 2.6 = 0.81 > 1 / 1.3
    rows.append(_row(bench, "mograph", 1.9, attn="sdpa", attention=12))  # a later measurement replaces it
    sdpa = {(ln["attn"], ln["shape"]): ln for ln in bench.grid_rows(rows)}[("sdpa", "8x512")]
    assert bench._goal(sdpa) == "ok"
    rows.append(_row(bench, "torch-compile", 1.0))  # 1.9 / 1.0 > 1.25 at 8x512: the torch.compile goal fails
    sdpa = {(ln["attn"], ln["shape"]): ln for ln in bench.grid_rows(rows)}[("sdpa", "8x512")]
    assert bench._goal(sdpa) == "miss (compile)"
    md = bench.markdown(rows, ["r.jsonl"])
    assert "| torchscript | eager | 8x512 | 4.600 | 2.000 | - | 2.200 | - | ort-t | 1.10 | miss | - |" in md
    assert "`bert/torchscript/eager/mograph/1x128` | boom" in md


def test_build_steps_and_dropped_intermediates(bench, tmp_path):
    g = bench.graph_for(tmp_path, False, "bert", "torchscript", "eager", "prefill")
    g.folder.mkdir(parents=True)
    # mograph and mograph-ortfp16 start from the same fused graph, built once, after the export
    assert bench.needed_steps(g, ["mograph-ortfp16", "exported", "mograph", "torch-eager"]) == [
        "fp32", "fused", "mograph-ortfp16", "exported", "mograph"]
    for step in ("fp32", "fused", "exported"):
        g.path(step).write_bytes(b"x")
    assert bench.needed_steps(g, ["exported", "mograph"]) == ["mograph"]
    g.path("fp32").unlink()  # dropped: made again only for a variant built from it
    assert bench.needed_steps(g, ["mograph"]) == ["mograph"]
    assert bench.needed_steps(g, ["ort-t", "mograph"]) == ["fp32", "ort-t", "mograph"]
    g.path("fp32").write_bytes(b"x")
    assert bench.drop_intermediates(g) == []  # ort-t, mograph, mograph-ortfp16 still to build: keep them
    for step in ("ort-t", "mograph", "mograph-ortfp16"):
        g.path(step).write_bytes(b"x")
    assert bench.drop_intermediates(g) == ["fp32", "fused"]  # onnxscript does not apply to TorchScript exports
    assert not g.path("fp32").exists() and not g.path("fused").exists() and g.path("mograph").exists()
    d = bench.graph_for(tmp_path, False, "bert", "dynamo", "eager", "prefill")
    d.folder.mkdir(parents=True)
    for step in ("fp32", "fused", "exported", "ort-t", "mograph", "mograph-ortfp16"):
        d.path(step).write_bytes(b"x")
    assert bench.drop_intermediates(d) == []  # onnxscript neither built nor failed
    d.record("onnxscript", {"error": "boom"})
    assert bench.drop_intermediates(d) == ["fp32", "fused"]
    # mograph-lengths (optional) is built from its own fused graph, and only counts when asked for
    e = bench.graph_for(tmp_path, False, "gpt2", "torchscript", "eager", "decode")
    e.folder.mkdir(parents=True)
    assert bench.needed_steps(e, ["mograph-lengths"]) == ["fp32", "fused-lengths", "mograph-lengths"]
    for step in ("fp32", "fused-lengths", "mograph-lengths"):
        e.path(step).write_bytes(b"x")
    assert bench.drop_intermediates(e, ["mograph-lengths"]) == ["fp32", "fused-lengths"]


def test_fp16_comparison_and_placement(bench):

    def placed(row, off, memcpy):
        row["placement"] = {"nodes": 10, "off_device": off, "memcpy": memcpy, "off_device_ops": {}}
        return row

    rows = [placed(_row(bench, "exported", 4.0), 1, 2), placed(_row(bench, "ort-t", 2.0, attention=12), 0, 2),
            placed(_row(bench, "mograph", 2.2, attention=12), 3, 5),
            placed(_row(bench, "mograph-ortfp16", 2.0, attention=12), 0, 2)]
    line = bench.grid_rows(rows)[0]
    assert line["fp16_ratio"] == pytest.approx(1.1) and line["memcpy_added"] == 3
    assert bench._placements(line) == "1/2 · 0/2 · - · 3/5 · 0/2 **(+3 Memcpy)**"
    lengths = bench.grid_rows(rows + [_row(bench, "mograph-lengths", 1.9, attention=12)])[0]
    assert lengths["lengths_ratio"] == pytest.approx(0.95) and lengths["ratio"] == pytest.approx(1.1)
    rows[2]["mograph_passes"] = {"fp16": {"fp16": {"converted": 90, "kept_fp32": 3, "kept_fp32.overflow": 2,
                                                     "kept_fp32.budget": 1, "kept_fp32.user": 0}}}
    rows[2]["ops"]["Cast"], rows[3]["ops"]["Cast"] = 7, 2
    md = bench.markdown(rows, ["r.jsonl"])
    assert "| 2.200 | 2.000 | ort-t | 1.10 | miss | 1.10 |" in md
    assert "| 3 (overflow 2, budget 1) / 7 · 2 |" in md
    # one Memcpy fewer than the export is not flagged
    rows[2]["placement"]["memcpy"] = 1
    line = bench.grid_rows(rows)[0]
    assert line["memcpy_added"] == 0 and "Memcpy)" not in bench._placements(line)


def test_list_estimates_and_spread(bench, tmp_path, capsys):
    assert bench._spread([10, 10, 10, 10], 2) == 20 and bench._spread([30, 5, 5], 4) == 30
    argv = ["--list", "--out", str(tmp_path / "r.jsonl"), "--cache", str(tmp_path / "c"), "--models", "bert,gpt2",
            "--exports", "dynamo", "--attn", "sdpa", "--shapes", "8x128,decode:8x512", "--variants",
            "exported,onnxscript,mograph,mograph-ortfp16", "--jobs", "2"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "bert/dynamo/sdpa/prefill: 4 cell(s) to time" in out  # no decode step for an encoder
    assert "gpt2/dynamo/sdpa/decode: 4 cell(s)" in out
    assert "12 cell(s) to time over 3 graph(s), 0 with something cached" in out
    serial = sum(bench.estimate_build(bench.graph_for(tmp_path / "c", False, m, "dynamo", "sdpa", k),
                                      ["fp32", "fused", "exported", "onnxscript", "mograph", "mograph-ortfp16"], False)
                 for m, k in (("bert", "prefill"), ("gpt2", "prefill"), ("gpt2", "decode")))
    assert f"build ~{serial:.0f} CPU-s serial" in out
    # a recorded build time replaces the table's guess
    g = bench.graph_for(tmp_path / "c", False, "bert", "dynamo", "sdpa", "prefill")
    g.folder.mkdir(parents=True)
    g.record("fp32", {"seconds": 1.0})
    steps = bench.needed_steps(g, ["exported"])
    assert bench.estimate_build(g, steps, False) == pytest.approx(1.0 + bench.BUILD_SECONDS[("dynamo", "exported")])
    # ... and other graphs' measured times replace the table, scaled per model
    measured = bench.measured_build_seconds(tmp_path / "c")
    assert measured == {("dynamo", "fp32"): 1.0}
    gpt2 = bench.graph_for(tmp_path / "c", False, "gpt2", "dynamo", "eager", "prefill")
    assert bench.estimate_build(gpt2, ["fp32"], False, measured) == pytest.approx(bench.MODEL_SCALE["gpt2"])


def test_markdown_keeps_the_text_above_the_marker(bench, tmp_path):
    md = tmp_path / "B.md"
    md.write_text("# Title\n\nHow to run: ...\n\n" + bench.KEEP_MARKER + "\n\nold tables\n")
    bench.write_markdown(md, "new tables\n")
    assert md.read_text() == "# Title\n\nHow to run: ...\n\n" + bench.KEEP_MARKER + "\n\nnew tables\n"
    plain = tmp_path / "P.md"
    plain.write_text("no marker\n")
    bench.write_markdown(plain, "new tables\n")
    assert plain.read_text() == "new tables\n"


def test_gpu_grid_script_lists_the_whole_grid(tmp_path):
    """``tools/gpu_grid.sh`` (the H200 calls of BENCHMARKS-GPU.md) selects the whole grid of issue 15."""
    script = ROOT / "tools" / "gpu_grid.sh"
    env = {**os.environ, "CACHE": str(tmp_path / "c"), "RESULTS": str(tmp_path / "r.jsonl"), "PATH": os.environ["PATH"]}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # `python` is this interpreter
    proc = subprocess.run(["bash", str(script), "list"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "684 cell(s) to time over 36 graph(s), 0 with something cached" in proc.stdout
    bad = subprocess.run(["bash", str(script), "bogus"], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_resume_and_crashed_cells(bench, tmp_path):
    path = tmp_path / "r.jsonl"
    res = bench.Results(path, retry_errors=False)
    res.write({"key": "a", "status": "started"})
    res.write({"key": "a", "status": "ok", "median_ms": 1.0})
    res.write({"key": "b", "status": "started"})  # the process died here
    res.write({"key": "c", "status": "error", "error": "x"})
    again = bench.Results(path, retry_errors=False)
    assert set(again.done) == {"a", "c"} and again.crashed == {"b"}
    retry = bench.Results(path, retry_errors=True)
    assert set(retry.done) == {"a"}
    path.write_text(path.read_text() + "{not json\n")  # a torn last line is ignored
    assert set(bench.Results(path, retry_errors=False).done) == {"a", "c"}


@pytest.mark.slow
@pytest.mark.torch
def test_smoke_cell_end_to_end(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    out, cache = tmp_path / "r.jsonl", tmp_path / "cache"
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--cache", str(cache), "--models", "bert",
           "--exports", "torchscript", "--attn", "eager", "--shapes", "1x16",
           "--variants", "exported,ort-t,mograph,mograph-ortfp16,torch-eager"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    final = {r["key"]: r for r in rows if r["status"] != "started"}
    assert set(final) == {"bert/torchscript/eager/exported/1x16", "bert/torchscript/eager/ort-t/1x16",
                          "bert/torchscript/eager/mograph/1x16", "bert/torchscript/eager/mograph-ortfp16/1x16",
                          "bert/torch/sdpa/torch-eager/1x16"}
    for r in final.values():
        assert r["status"] == "ok", r
        assert r["median_ms"] > 0 and r["cosine"] > 0.999
    # float16 really ran: not bit-equal to the float32 reference
    assert final["bert/torchscript/eager/exported/1x16"]["max_abs"] > 0
    assert final["bert/torchscript/eager/mograph/1x16"]["ops"]["attention"] >= 1
    # both fp16 conversions of mograph's fused graph keep its attention; ONNX Runtime's profile said where nodes ran
    assert final["bert/torchscript/eager/mograph-ortfp16/1x16"]["ops"]["attention"] >= 1
    for key in ("exported", "mograph", "mograph-ortfp16"):
        where = final[f"bert/torchscript/eager/{key}/1x16"]["placement"]
        assert where["profiled"] and where["nodes"] > 0 and where["memcpy"] == 0 and where["off_device"] == 0
    # a second call finds every cell done and the graphs cached: it writes nothing
    before = out.read_text()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0 and out.read_text() == before
    md = tmp_path / "B.md"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--markdown", str(md), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "| torchscript | eager | 1x16 |" in md.read_text()


def test_rows_of_another_lease_are_not_compared(bench):
    """Several --out files: a peer (or torch) row measured in another lease than mograph's is left out of the
    cell, so no ratio mixes two machines' noise."""
    old = [dict(_row(bench, "ort-t", 1.0, attention=12), time="2026-12-01T20:00:00+00:00"),
           dict(_row(bench, "torch-eager", 1.0), time="2026-12-01T20:00:00+00:00")]
    new = [dict(_row(bench, "exported", 4.0), time="2026-12-02T04:00:00+00:00"),
           dict(_row(bench, "mograph", 2.0, attention=12), time="2026-12-02T04:10:00+00:00")]
    line = bench.grid_rows(old + new)[0]
    assert line["ort-t"] is None and line.get("torch-eager") is None
    assert line["best_peer"] == "exported" and line["ratio"] == pytest.approx(0.5)
    same = [dict(r, time="2026-12-02T04:20:00+00:00") for r in old]
    line = bench.grid_rows(same + new)[0]
    assert line["best_peer"] == "ort-t" and line["ratio"] == pytest.approx(2.0) and line["torch-eager"] == 1.0
