"""Numeric validation: feeds, tolerances, the Verifier and diff_models, the ORT backend."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph import ir_io
from mograph.backends import ort as ort_backend
from mograph.errors import BackendUnavailableError, ModelError, UsageError
from mograph.validate import Verifier, diff_models, make_feeds, tolerance_for

OPSET = [helper.make_opsetid("", 17)]


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=OPSET)


def matmul_model(w: np.ndarray, dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """y = x @ w + 1, x: [batch, 8]."""
    one = np.ones((w.shape[1],), dtype=w.dtype)
    return _model(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "one"], ["y"])],
        [helper.make_tensor_value_info("x", dtype, ["batch", w.shape[0]])],
        [helper.make_tensor_value_info("y", dtype, ["batch", w.shape[1]])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(one, "one")],
    )


def embedding_model(vocab: int = 30, types: int = 2) -> onnx.ModelProto:
    """Token + token-type embeddings, a mask sum, and a Gather on axis 1 of a 3x7 table."""
    rng = np.random.default_rng(1)
    words = numpy_helper.from_array(rng.standard_normal((vocab, 4)).astype(np.float32), "words")
    segs = numpy_helper.from_array(rng.standard_normal((types, 4)).astype(np.float32), "segs")
    cols = numpy_helper.from_array(rng.standard_normal((3, 7)).astype(np.float32), "cols")
    return _model(
        [
            helper.make_node("Gather", ["words", "input_ids"], ["we"]),
            helper.make_node("Gather", ["segs", "token_type_ids"], ["se"]),
            helper.make_node("Add", ["we", "se"], ["emb"]),
            helper.make_node("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT),
            helper.make_node("ReduceSum", ["mf"], ["count"], keepdims=0),
            helper.make_node("Cast", ["col_idx"], ["col_idx64"], to=TensorProto.INT64),
            helper.make_node("Gather", ["cols", "col_idx64"], ["picked"], axis=1),
        ],
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("col_idx", TensorProto.INT32, [5]),
        ],
        [
            helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["batch", "seq", 4]),
            helper.make_tensor_value_info("count", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("picked", TensorProto.FLOAT, [3, 5]),
        ],
        [words, segs, cols],
    )


def _w(shape=(8, 4), seed=0, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _ir(proto: onnx.ModelProto) -> ir.Model:
    return ir_io.load_model(proto)


# ---------------------------------------------------------------------------------------------------


def test_identical_models_pass():
    w = _w()
    verifier = Verifier(_ir(matmul_model(w)), shapes={"x": (2, 8)})
    check = verifier.check(_ir(matmul_model(w.copy())), family="fusion")
    assert check["passed"] is True
    out = check["outputs"]["y"]
    assert out["max_abs"] == 0.0 and out["cosine"] == pytest.approx(1.0)
    peak = float(np.abs(verifier.reference["y"]).max())  # the floor follows the output's scale (PEAK_FRACTION)
    assert out["atol"] == pytest.approx(max(1e-4, 0.1 * 1e-3 * peak)) and out["rtol"] == 1e-3
    assert check["seed"] == 0 and check["feeds"]["x"]["shape"] == [2, 8]
    assert check["summary"].startswith("passed")
    import json

    json.dumps(check, allow_nan=False)  # strictly JSON-serialisable


def test_perturbed_weight_fails_with_correct_max_abs():
    w = _w()
    w2 = w.copy()
    w2[3, 1] += 0.25
    original = _ir(matmul_model(w))
    verifier = Verifier(original, shapes={"x": (3, 8)}, seed=7)
    check = verifier.check(_ir(matmul_model(w2)), family="fusion")
    assert check["passed"] is False
    x = verifier.feeds["x"]
    ref = x @ w + 1
    got = x @ w2 + 1
    expected_abs = float(np.max(np.abs(got - ref)))
    expected_cos = float(np.dot(ref.ravel(), got.ravel()) / (np.linalg.norm(ref) * np.linalg.norm(got)))
    out = check["outputs"]["y"]
    assert out["max_abs"] == pytest.approx(expected_abs, rel=1e-5)
    assert out["cosine"] == pytest.approx(expected_cos, rel=1e-6)
    assert out["passed"] is False and out["failures"]
    assert "'y'" in check["summary"] and "FAILED" in check["summary"]
    message = verifier.describe_failure(check)
    assert "output 'y'" in message and "atol" in message and "seed 7" in message


def test_gather_index_feeds_stay_in_range_and_run():
    verifier = Verifier(_ir(embedding_model(vocab=30, types=2)), shapes={"input_ids": (2, 9)})
    feeds = verifier.feeds
    assert feeds["input_ids"].shape == (2, 9)
    assert feeds["token_type_ids"].shape == (2, 9)  # "batch"/"seq" bound by input_ids' shape
    assert feeds["input_ids"].min() >= 0 and feeds["input_ids"].max() < 30
    assert set(np.unique(feeds["token_type_ids"])) <= {0, 1}
    assert set(np.unique(feeds["attention_mask"])) <= {0, 1}
    assert (feeds["attention_mask"][:, 0] == 1).all()
    assert feeds["col_idx"].dtype == np.int32  # found through a Cast: Gather axis=1 over 7 columns
    assert feeds["col_idx"].min() >= 0 and feeds["col_idx"].max() < 7
    assert verifier.feed_info["inputs"]["input_ids"]["range"] == [0, 29]
    check = verifier.check(_ir(embedding_model(vocab=30, types=2)))
    assert check["passed"]


def test_index_feeds_stay_in_range_over_many_seeds():
    model = _ir(embedding_model(vocab=5, types=2))
    for seed in range(20):
        feeds, _ = make_feeds(model, shapes={"input_ids": (4, 16)}, seed=seed)
        assert feeds["input_ids"].max() < 5 and feeds["col_idx"].max() < 7


def test_fp16_tolerances_are_looser_than_fp32():
    w = _w()
    delta = np.zeros_like(w)
    delta[0, 0] = 5e-3  # far past the float32 bound, inside the float16 one
    x_shape = {"x": (16, 8)}
    v32 = Verifier(_ir(matmul_model(w)), shapes=x_shape)
    assert not v32.check(_ir(matmul_model(w + delta)), family="fusion")["passed"]
    w16 = w.astype(np.float16)
    v16 = Verifier(_ir(matmul_model(w16, TensorProto.FLOAT16)), shapes=x_shape)
    assert v16.feeds["x"].dtype == np.float16
    check = v16.check(_ir(matmul_model((w + delta).astype(np.float16), TensorProto.FLOAT16)), family="fusion")
    assert check["passed"], check["summary"]
    assert check["outputs"]["y"]["atol"] == 1e-2 and check["outputs"]["y"]["dtype"] == "float16"
    # A real error in float16 still fails.
    check = v16.check(_ir(matmul_model((w + 200 * delta).astype(np.float16), TensorProto.FLOAT16)))
    assert not check["passed"]


def test_tolerance_table_by_dtype_and_family():
    assert tolerance_for(np.int64, "fusion").atol == 0.0
    assert tolerance_for(np.float16, "fusion").atol > tolerance_for(np.float32, "fusion").atol
    assert tolerance_for(ml_dtypes.bfloat16, "fusion").atol >= tolerance_for(np.float16, "fusion").atol
    quant = tolerance_for(np.float32, "quant")
    assert quant.atol is None and quant.min_cosine is not None
    mixed = tolerance_for(np.float32, {"fusion", "quant"})
    assert mixed.atol is None and mixed.min_cosine == quant.min_cosine  # the loosest applies
    assert tolerance_for(np.int64, {"fusion", "prune"}).max_mismatch == pytest.approx(0.05)
    assert tolerance_for(np.float32, "some-plugin-family") == tolerance_for(np.float32, "fusion")
    over = tolerance_for(np.float32, "quant", atol=0.5)
    assert over.atol == 0.5 and over.rtol == 0.0
    assert tolerance_for(np.int32, "fusion", atol=3.0).atol == 0.0  # overrides are for floats only


def test_family_selects_tolerance():
    w = _w()
    w2 = w * 1.01  # a 1% change: a quantization-sized error
    verifier = Verifier(_ir(matmul_model(w)), shapes={"x": (4, 8)})
    assert not verifier.check(_ir(matmul_model(w2)), family="fusion")["passed"]
    assert verifier.check(_ir(matmul_model(w2)), family="quant")["passed"]
    assert verifier.check(_ir(matmul_model(w2)), family={"fusion", "quant"})["passed"]
    loose = Verifier(_ir(matmul_model(w)), shapes={"x": (4, 8)}, atol=1.0, rtol=1.0)
    assert loose.check(_ir(matmul_model(w2)), family="fusion")["passed"]
    strict = Verifier(_ir(matmul_model(w)), shapes={"x": (4, 8)}, min_cosine=0.999999999)
    assert not strict.check(_ir(matmul_model(w2)), family="quant")["passed"]


def test_user_npz_feeds_are_used_exactly(tmp_path):
    w = _w()
    x = np.linspace(-3, 3, 5 * 8, dtype=np.float32).reshape(5, 8)
    path = tmp_path / "feeds.npz"
    np.savez(path, x=x)
    verifier = Verifier(_ir(matmul_model(w)), feeds=str(path))
    assert np.array_equal(verifier.feeds["x"], x)
    np.testing.assert_allclose(verifier.reference["y"], x @ w + 1, rtol=1e-5, atol=1e-5)
    check = verifier.check(_ir(matmul_model(w)))
    assert check["feeds"]["x"] == {"shape": [5, 8], "dtype": "float32", "source": "file"}
    np.savez(tmp_path / "bad.npz", nope=x)
    with pytest.raises(UsageError, match="unknown input"):
        Verifier(_ir(matmul_model(w)), feeds=str(tmp_path / "bad.npz"))
    with pytest.raises(UsageError, match="no such file"):
        Verifier(_ir(matmul_model(w)), feeds=str(tmp_path / "missing.npz"))


def _string_model() -> onnx.ModelProto:
    """y = float(LabelEncoder(text)): a string input, as skl2onnx's text pipelines take."""
    graph = helper.make_graph(
        [helper.make_node("LabelEncoder", ["text"], ["ids"], domain="ai.onnx.ml", keys_strings=["cat", "dog"],
                          values_int64s=[3, 5], default_int64=-1),
         helper.make_node("Cast", ["ids"], ["y"], to=TensorProto.FLOAT)],
        "g", [helper.make_tensor_value_info("text", TensorProto.STRING, ["n", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1])])
    return helper.make_model(graph, opset_imports=[*OPSET, helper.make_opsetid("ai.onnx.ml", 2)])


def test_string_inputs_are_fed_from_a_unicode_npz(tmp_path):
    """A string input can only come from --feeds; the given feed was refused as if none had been given (exit 2,
    "random feeds cannot make one; give --feeds") on skl2onnx's TfidfVectorizer and OneHotEncoder pipelines."""
    path = tmp_path / "text.npz"
    np.savez(path, text=np.asarray([["dog"], ["cat"], ["emu"]], dtype=str))
    verifier = Verifier(_ir(_string_model()), feeds=str(path))
    assert verifier.feeds["text"].dtype == object and verifier.feeds["text"].shape == (3, 1)
    np.testing.assert_array_equal(verifier.reference["y"], np.array([[5.0], [3.0], [-1.0]], np.float32))
    check = verifier.check(_ir(_string_model()), family="cleanup")
    assert check["passed"] is True and check["feeds"]["text"]["source"] == "file"
    # near misses: a numeric feed for the string input, no feed at all, an object (pickled) archive
    np.savez(tmp_path / "num.npz", text=np.zeros((3, 1), np.float32))
    with pytest.raises(UsageError, match="model's input is a string tensor"):
        Verifier(_ir(_string_model()), feeds=str(tmp_path / "num.npz"))
    with pytest.raises(UsageError, match="random feeds cannot make one; give --feeds"):
        Verifier(_ir(_string_model()), shapes={"text": (3, 1)})
    np.savez(tmp_path / "obj.npz", text=np.asarray([["dog"]], dtype=object))
    with pytest.raises(UsageError, match="save strings as a unicode array"):
        Verifier(_ir(_string_model()), feeds=str(tmp_path / "obj.npz"))


def test_dynamic_dims_from_shapes_and_defaults():
    model = _model(
        [helper.make_node("Add", ["a", "b"], ["c"])],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", "seq"]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, ["batch", "seq"])],
    )
    verifier = Verifier(_ir(model), shapes={"a": (3, 5)})
    assert verifier.feeds["a"].shape == (3, 5) and verifier.feeds["b"].shape == (3, 5)
    assert verifier.feed_info["defaulted_dims"] == {}
    defaulted = Verifier(_ir(model))
    assert defaulted.feeds["a"].shape == (1, 16)
    assert defaulted.feed_info["defaulted_dims"] == {"batch": 1, "seq": 16}
    unnamed = _model(
        [helper.make_node("Relu", ["a"], ["c"])],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, None, 4])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [None, None, 4])],
    )
    feeds, info = make_feeds(_ir(unnamed))
    assert feeds["a"].shape == (1, 16, 4)
    assert info["defaulted_dims"] == {"a[0]": 1, "a[1]": 16}
    with pytest.raises(UsageError, match="fixed at 4"):
        make_feeds(_ir(unnamed), shapes={"a": (1, 2, 3)})
    with pytest.raises(UsageError, match="unknown input"):
        make_feeds(_ir(unnamed), shapes={"nope": (1,)})


def test_a_dim_named_by_an_expression_is_sized_from_its_parts():
    """optimum names a decoder's mask length ``past_sequence_length + sequence_length`` (the mask comes before the
    cache inputs): the random feeds size it as the sum of what the other inputs bind, so the export runs on them
    (sized as a new symbol it was 16 wide against a 64-long past: the export's own mask lookup failed)."""
    model = _model(
        [helper.make_node("Shape", ["mask"], ["n"]), helper.make_node("Identity", ["past"], ["p"])],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
         helper.make_tensor_value_info("mask", TensorProto.INT64,
                                       ["batch_size", "past_sequence_length + sequence_length"]),
         helper.make_tensor_value_info("past", TensorProto.FLOAT, ["batch_size", 2, "past_sequence_length", 8]),
         helper.make_tensor_value_info("twice", TensorProto.FLOAT, ["2*sequence_length - 1"])],
        [helper.make_tensor_value_info("n", TensorProto.INT64, [2]),
         helper.make_tensor_value_info("p", TensorProto.FLOAT, ["batch_size", 2, "past_sequence_length", 8])],
    )
    feeds, info = make_feeds(_ir(model))
    assert list(feeds) == ["ids", "mask", "past", "twice"]  # the model's order
    seq, past = feeds["ids"].shape[1], feeds["past"].shape[2]
    assert feeds["mask"].shape == (1, past + seq) and feeds["twice"].shape == (2 * seq - 1,)
    feeds, _ = make_feeds(_ir(model), shapes={"past": (1, 2, 5, 8), "ids": (1, 3)})
    assert feeds["mask"].shape == (1, 8)
    alone = _model([helper.make_node("Identity", ["mask"], ["m"])],
                   [helper.make_tensor_value_info("mask", TensorProto.INT64, ["b", "p + s"])],
                   [helper.make_tensor_value_info("m", TensorProto.INT64, ["b", "p + s"])])
    feeds, info = make_feeds(_ir(alone))  # parts no other input carries: each its default size
    assert feeds["mask"].shape == (1, 32) and info["defaulted_dims"] == {"b": 1, "p": 16, "s": 16}


def test_a_decoder_mask_named_by_its_own_symbol_covers_the_past_and_the_new_tokens():
    """A TorchScript decoder export names its mask length as its author chose (``dynamic_axes``: ``total``), not
    ``past + seq``: sized alone it was 16 wide beside a 64-long past, the export itself failed on the feeds, and
    ``--verify`` refused a real Qwen2.5-Coder-0.5B decode graph (exit 3). A rank-2 mask whose symbol no other
    input carries, beside a rank-4 ``past`` input and integer tokens, is now sized past + seq."""
    def decoder(mask_dims: list, ids: str = "input_ids") -> onnx.ModelProto:
        return _model(
            [helper.make_node("Shape", ["attention_mask"], ["n"]), helper.make_node("Identity", ["past.0.key"], ["p"])],
            [helper.make_tensor_value_info(ids, TensorProto.INT64, ["batch", "seq"]),
             helper.make_tensor_value_info("attention_mask", TensorProto.INT64, mask_dims),
             helper.make_tensor_value_info("past.0.key", TensorProto.FLOAT, ["batch", 2, "past", 8])],
            [helper.make_tensor_value_info("n", TensorProto.INT64, [2]),
             helper.make_tensor_value_info("p", TensorProto.FLOAT, ["batch", 2, "past", 8])])

    feeds, info = make_feeds(_ir(decoder(["batch", "total"])))
    seq, past = feeds["input_ids"].shape[1], feeds["past.0.key"].shape[2]
    assert feeds["attention_mask"].shape == (1, past + seq) == (1, 80)
    assert any("'total' sized 80 as past + seq" in n for n in info["notes"]), info["notes"]
    feeds, _ = make_feeds(_ir(decoder(["batch", "total"])), shapes={"past.0.key": (1, 2, 5, 8), "input_ids": (1, 3)})
    assert feeds["attention_mask"].shape == (1, 8)
    feeds, _ = make_feeds(_ir(decoder(["batch", "total"])), shapes={"attention_mask": (1, 4)})  # the user's wins
    assert feeds["attention_mask"].shape == (1, 4)
    # a mask sharing the token dim (a prefill graph) or with no past beside it keeps the plain default
    assert make_feeds(_ir(decoder(["batch", "seq"])))[0]["attention_mask"].shape == (1, 16)
    no_past = _model([helper.make_node("Shape", ["attention_mask"], ["n"])],
                     [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
                      helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])],
                     [helper.make_tensor_value_info("n", TensorProto.INT64, [2])])
    assert make_feeds(_ir(no_past))[0]["attention_mask"].shape == (1, 16)


def test_changed_outputs_fail_with_a_reason():
    w = _w()
    verifier = Verifier(_ir(matmul_model(w)), shapes={"x": (1, 8)})
    renamed = matmul_model(w)
    renamed.graph.node[1].output[0] = "z"
    renamed.graph.output[0].name = "z"
    check = verifier.check(_ir(renamed))
    assert not check["passed"] and "output names changed" in check["reason"]
    extra = matmul_model(w)
    extra.graph.output.append(helper.make_tensor_value_info("xw", TensorProto.FLOAT, None))
    check = verifier.check(_ir(extra))
    assert not check["passed"] and "count changed from 1 to 2" in check["reason"]
    assert "count changed" in verifier.describe_failure(check)


def test_shape_change_fails():
    verifier = Verifier(_ir(matmul_model(_w((8, 4)))), shapes={"x": (1, 8)})
    check = verifier.check(_ir(matmul_model(_w((8, 5)))))
    assert not check["passed"]
    assert "shape (1, 5) differs" in check["outputs"]["y"]["failures"][0]


def test_nan_in_both_models_is_agreement():
    model = _model(
        [helper.make_node("Log", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])],
    )
    verifier = Verifier(_ir(model))
    assert np.isnan(verifier.reference["y"]).any()  # uniform [-1, 1): negative inputs
    check = verifier.check(_ir(model))
    assert check["passed"] and check["outputs"]["y"]["nan_both"] > 0


def test_int_outputs_are_exact():
    def argmax_model(w):
        return _model(
            [helper.make_node("MatMul", ["x", "w"], ["s"]), helper.make_node("ArgMax", ["s"], ["i"], axis=1)],
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 8])],
            [helper.make_tensor_value_info("i", TensorProto.INT64, [16, 1])],
            [numpy_helper.from_array(w, "w")],
        )

    w = _w()
    verifier = Verifier(_ir(argmax_model(w)))
    same = verifier.check(_ir(argmax_model(w)))
    assert same["passed"] and (verifier.reference["i"] == 0).any()
    assert same["outputs"]["i"]["max_abs"] == 0.0 and same["outputs"]["i"]["max_rel"] == 0.0  # not 0/0 ("nan")
    assert "max rel 0," in same["summary"]
    check = verifier.check(_ir(argmax_model(-w)))
    assert not check["passed"] and check["outputs"]["i"]["atol"] == 0.0


def test_external_data_and_large_models_go_through_a_file(tmp_path, monkeypatch):
    w = _w((64, 32))
    path = tmp_path / "ext.onnx"
    onnx.save(matmul_model(w), str(path), save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    model = ir_io.load_model(path)
    # External initializers in one folder: bytes, their data read from that folder (no copy of the weights).
    assert not ort_backend.needs_file(model)
    verifier = Verifier(model, shapes={"x": (2, 64)})
    assert verifier.check(model)["passed"]
    # In memory but "above 2 GB": lower the limit to force the temporary-file path.
    monkeypatch.setenv("MOGRAPH_PROTO_LIMIT", "1024")
    in_memory = _ir(matmul_model(w))
    assert ort_backend.needs_file(in_memory)
    session = ort_backend.make_session(in_memory)
    assert session._mograph_spilled is not None and Path(session._mograph_spilled.path).is_file()
    assert verifier.check(in_memory)["passed"]


def test_bfloat16_inputs_and_outputs():
    model = _model(
        [
            helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
            helper.make_node("Relu", ["xf"], ["r"]),
            helper.make_node("Cast", ["r"], ["y"], to=TensorProto.BFLOAT16),
        ],
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 3])],
    )
    verifier = Verifier(_ir(model))
    assert verifier.feeds["x"].dtype == ml_dtypes.bfloat16
    assert verifier.reference["y"].dtype == ml_dtypes.bfloat16
    expected = np.maximum(verifier.feeds["x"].astype(np.float32), 0)
    np.testing.assert_array_equal(verifier.reference["y"].astype(np.float32), expected)
    check = verifier.check(_ir(model))
    assert check["passed"] and check["outputs"]["y"]["atol"] == 5e-2


def test_diff_models_and_original_failures(tmp_path):
    w = _w()
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    onnx.save(matmul_model(w), str(a))
    onnx.save(matmul_model(w + 1), str(b))
    same = diff_models(a, a, shapes={"x": (2, 8)}, seed=3)
    assert same["passed"] and same["seed"] == 3 and "tolerances" in same
    differ = diff_models(a, b, shapes={"x": (2, 8)})
    assert not differ["passed"] and "output 'y'" in differ["failure"]
    with pytest.raises(ModelError):
        diff_models(a, tmp_path / "missing.onnx")
    broken = matmul_model(w)
    broken.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(ModelError, match="original model"):
        Verifier(broken, shapes={"x": (1, 8)})
    check = Verifier(matmul_model(w), shapes={"x": (1, 8)}).check(broken)
    assert not check["passed"] and "cannot be loaded" in check["reason"]


def _shift(half: bool, off: float = 0.0) -> onnx.ModelProto:
    """y = (x + 8) - (8 - off) with float32 input and output: computed in float16 between two Casts when ``half``
    (what onnxconverter-common's ``keep_io_types`` writes, with its value_info), in float32 otherwise."""
    f = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    eight = numpy_helper.from_array(np.array(8.0, np.float16 if half else np.float32), "eight")
    back = numpy_helper.from_array(np.array(8.0 - off, np.float16 if half else np.float32), "back")
    nodes = [helper.make_node("Add", ["xi", "eight"], ["s"]), helper.make_node("Sub", ["s", "back"], ["yi"])]
    if half:
        nodes = [helper.make_node("Cast", ["x"], ["xi"], to=f), *nodes,
                 helper.make_node("Cast", ["yi"], ["y"], to=TensorProto.FLOAT)]
    else:
        nodes = [helper.make_node("Identity", ["x"], ["xi"]), *nodes, helper.make_node("Identity", ["yi"], ["y"])]
    proto = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])], [eight, back])
    proto.graph.value_info.append(helper.make_tensor_value_info("yi", f, [4, 64]))
    return proto


def test_float32_output_computed_in_float16_is_judged_at_float16_precision():
    """A float16 model with float32 I/O (onnxconverter-common's) against a candidate off by a quarter of float16's
    step at 8 (2**-9): within float16 rounding, beyond float32's bound near zero.  float32's bound refused such
    differences (validate exit 5 on a correct float16 model, ONNX Runtime's optimizations on against off: 0.02 at
    outputs near 20); an output cast from float16 is now judged at float16's bound.  The near miss: the same
    difference on a float32 model's output keeps float32's bound and fails."""
    feeds = {"x": np.random.default_rng(3).uniform(-3, 3, (4, 64)).astype(np.float32)}
    half = Verifier(_ir(_shift(half=True)), feeds=feeds)
    assert {k: np.dtype(v).name for k, v in half.computed_in.items()} == {"y": "float16"}
    check = half.check(_ir(_shift(half=False, off=2.0**-9)), family="fusion")
    out = check["outputs"]["y"]
    assert check["passed"] is True, check["summary"]
    assert out["rtol"] == 1e-2 and out["max_abs"] == pytest.approx(2.0**-9, rel=1e-3)  # float16's bound
    strict = Verifier(_ir(_shift(half=False)), feeds=feeds)
    assert strict.computed_in == {}
    worse = strict.check(_ir(_shift(half=False, off=2.0**-9)), family="fusion")
    assert worse["passed"] is False and worse["outputs"]["y"]["rtol"] == 1e-3


def test_missing_onnxruntime_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(BackendUnavailableError, match=r"mograph\[ort\]"):
        ort_backend.make_session(matmul_model(_w()))


def test_backend_plugin_registers_ort_without_importing_it():
    code = (
        "import sys, mograph.backends as b\n"
        "backends = {x.name: x for x in b.mograph_add_backends()}\n"
        "assert 'ort' in backends and backends['ort'].available() is True\n"
        "assert backends['ort'].description and backends['ort'].extra == 'ort'\n"
        "assert 'onnxruntime' not in sys.modules, 'registration imported onnxruntime'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ort_runner_runs_with_optimizations():
    w = _w()
    runner = ort_backend.BACKEND.make_runner(matmul_model(w), optimizations=True, threads=1)
    x = np.ones((2, 8), np.float32)
    np.testing.assert_allclose(runner({"x": x})["y"], x @ w + 1, rtol=1e-5)


def test_output_made_float16_is_judged_at_float16_precision():
    w = _w()
    half = matmul_model(w)
    # The same computation, with a Cast of the output to float16 (what a precision pass may leave).
    half.graph.node[1].output[0] = "y32"
    half.graph.node.append(helper.make_node("Cast", ["y32"], ["y"], to=TensorProto.FLOAT16))
    half.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    verifier = Verifier(_ir(matmul_model(w)), shapes={"x": (4, 8)})
    check = verifier.check(_ir(half), family="fusion")
    assert check["passed"], check["summary"]
    out = check["outputs"]["y"]
    assert out["actual_dtype"] == "float16" and out["atol"] == 1e-2


# --- the layers behind mograph.validate, and backend runners ----------------------------------------


def test_every_public_name_keeps_its_import_path():
    import mograph.validate as v
    from mograph.validate import _compare, _feeds, _tolerances, _verify

    assert v.__all__ == [
        "Tolerance", "FAMILY_TOLERANCES", "TIGHT", "tolerance_for", "dtype_class", "load_feeds", "make_feeds",
        "FEED_LIMIT_BYTES", "graph_inputs", "Verifier", "diff_models",
    ]
    assert v.FEED_LIMIT_BYTES is _feeds.FEED_LIMIT_BYTES
    assert v.Tolerance is _tolerances.Tolerance and v.tolerance_for is _tolerances.tolerance_for
    assert v.make_feeds is _feeds.make_feeds and v.graph_inputs is _feeds.graph_inputs
    assert v.compare_outputs is _compare.compare_outputs
    assert v.Verifier is _verify.Verifier and v.diff_models is _verify.diff_models


def test_verifier_checks_a_backend_runner_with_the_same_verdict():
    w = _w()
    verifier = Verifier(matmul_model(w), shapes={"x": (2, 8)})
    x = verifier.feeds["x"]

    def good(feeds):
        return {"y": feeds["x"] @ w + 1}

    check = verifier.check(matmul_model(w), runner=good, label="numpy")
    assert check["passed"] is True and check["candidate"] == "numpy"
    peak = float(np.abs(verifier.reference["y"]).max())  # the float32 row of the table, as for --verify
    assert check["outputs"]["y"]["atol"] == pytest.approx(max(1e-4, 0.1 * 1e-3 * peak))

    def off(feeds):
        return {"y": feeds["x"] @ w + 1.01}

    bad = verifier.check(matmul_model(w), runner=off, label="numpy")
    assert bad["passed"] is False and "elements beyond both atol" in bad["outputs"]["y"]["failures"][0]

    renamed = verifier.check(None, runner=lambda feeds: {"z": x @ w + 1})
    assert renamed["reason"] == "output names changed: original ['y'], optimized ['z']"

    def crashes(feeds):
        raise RuntimeError("kernel exploded")

    failed = verifier.check(None, runner=crashes, label="numpy")
    assert failed["reason"] == "numpy fails on the verification feeds: RuntimeError: kernel exploded"


def test_diff_models_on_a_backend_runs_both_sides_there():
    calls = []

    class Numpy:
        name = "numpy"

        def make_runner(self, model, *, optimizations=True, threads=None, providers=None):
            calls.append(optimizations)
            return ort_backend.BACKEND.make_runner(model, optimizations=False)

    w = _w()
    check = diff_models(matmul_model(w), matmul_model(w), backend=Numpy(), shapes={"x": (3, 8)})
    assert check["passed"] is True and calls == [False, False]
    assert check["backend"] == "backend 'numpy' (its graph optimizations off)"


def _dynamic_quant_model(w: np.ndarray, shift: np.ndarray | None = None) -> onnx.ModelProto:
    """x quantized while it runs (DynamicQuantizeLinear), then MatMulInteger with int8 ``w``, as ONNX Runtime's
    quantize_dynamic writes a Linear (the T5 encoder of issue 27's held-out run); ``shift`` is added to x first."""
    pre = [] if shift is None else [helper.make_node("Add", ["x", "shift"], ["xin"])]
    nodes = [*pre, helper.make_node("DynamicQuantizeLinear", ["x" if shift is None else "xin"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "w", "xz", "wz"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["accf", "xs"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", w.shape[1]])],
                  [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0, np.int8), "wz")]
                  + ([] if shift is None else [numpy_helper.from_array(shift, "shift")]))


def test_failure_on_a_model_that_quantizes_activations_says_why_it_can_be_noise():
    """A fusion's last-bit change before DynamicQuantizeLinear moved a T5 encoder's output by 0.003 (exit 5);
    the failure now says that the original quantizes activations while it runs, when the difference is no
    larger than one quantization step makes it.  A larger one's, and a float model's, does not."""
    w = np.random.default_rng(2).integers(-20, 20, (8, 4)).astype(np.int8)
    verifier = Verifier(_ir(_dynamic_quant_model(w)), shapes={"x": (3, 8)}, seed=7)
    w2 = w.copy()
    w2[0, 0] += 5
    check = verifier.check(_ir(_dynamic_quant_model(w2)), family="fusion")
    assert check["passed"] is False
    message = verifier.describe_failure(check)
    # a real change (an int8 weight +5: max abs 4.97, rel 0.72) is larger than one quantization step moves the
    # output (0.41 here, verifier.one_step): not explained away as the quantizer's rounding
    assert "quantizes activations" not in message
    assert check["outputs"]["y"]["max_abs"] > verifier.one_step["y"]
    # the T5 case: the input of the quantizer rounds differently (here 0.6 of a step more on x[:, 0]), so some
    # quantized elements move by one step: within the one-step spread, and the failure says why it can be noise
    x = verifier.feeds["x"]
    step = (max(float(x.max()), 0.0) - min(float(x.min()), 0.0)) / 255
    shift = np.zeros(8, np.float32)
    shift[0] = 0.6 * step
    check = verifier.check(_ir(_dynamic_quant_model(w, shift=shift)), family="fusion")
    assert check["passed"] is False
    assert 0 < check["outputs"]["y"]["max_abs"] <= verifier.one_step["y"]
    message = verifier.describe_failure(check)
    assert "the original quantizes activations while it runs (DynamicQuantizeLinear / QuantizeLinear)" in message
    wf = _w()
    float_verifier = Verifier(_ir(matmul_model(wf)), shapes={"x": (3, 8)}, seed=7)
    wf2 = wf.copy()
    wf2[3, 1] += 0.25
    check = float_verifier.check(_ir(matmul_model(wf2)), family="fusion")
    assert check["passed"] is False and "quantizes activations" not in float_verifier.describe_failure(check)


def _static_quant_model(w: np.ndarray, shift: np.ndarray) -> onnx.ModelProto:
    """x + shift quantized with a constant per-tensor scale (QuantizeLinear / DequantizeLinear), then x @ w."""
    nodes = [helper.make_node("Add", ["x", "shift"], ["xin"]),
             helper.make_node("QuantizeLinear", ["xin", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("MatMul", ["xd", "w"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", w.shape[1]])],
                  [numpy_helper.from_array(w, "w"), numpy_helper.from_array(shift, "shift"),
                   numpy_helper.from_array(np.array(0.05, np.float32), "s"),
                   numpy_helper.from_array(np.array(0, np.int8), "z")])


def test_quantize_linear_hint_only_within_its_scale_step():
    """A QuantizeLinear of an activation with a constant scale: the one-step spread is measured with that
    scale; 0.6 of a step more on one input column gets the hint, a weight off by 1.0 (20 steps' worth) does not."""
    w = _w()
    zero = np.zeros(8, np.float32)
    verifier = Verifier(_ir(_static_quant_model(w, zero)), shapes={"x": (3, 8)}, seed=3)
    shift = zero.copy()
    shift[2] = 0.6 * 0.05
    check = verifier.check(_ir(_static_quant_model(w, shift)), family="fusion")
    assert check["passed"] is False and "quantizes activations" in verifier.describe_failure(check)
    w2 = w.copy()
    w2[2, 1] += 1.0
    check = verifier.check(_ir(_static_quant_model(w2, zero)), family="fusion")
    assert check["passed"] is False and "quantizes activations" not in verifier.describe_failure(check)
    assert 0 < verifier.one_step["y"] < check["outputs"]["y"]["max_abs"]


def test_exact_bound_floor_follows_the_output_scale():
    """A deep exact rewrite is off by rounding relative to the output's scale: an output peaking at 1000 with an
    error of 0.05 on an element near zero passes (floor 1e-4 x 1000 = 0.1); 0.2 fails; a user's --atol is taken
    as given (0.05 fails at atol 1e-4)."""
    import onnx_ir as ir
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = ir.serde.deserialize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                                         ir_version=10))
    x = np.array([1000.0, -3.0, 0.001, 0.5], np.float32)

    def runner(err):
        return lambda feeds: {"y": feeds["x"] + np.array([0, 0, err, 0], np.float32)}

    verifier = Verifier(model, feeds={"x": x})
    ok = verifier.check(model, runner=runner(0.05), label="numpy", family="fusion")
    assert ok["passed"] is True and ok["outputs"]["y"]["atol"] == pytest.approx(0.1)
    assert verifier.check(model, runner=runner(0.2), label="numpy", family="fusion")["passed"] is False
    strict = Verifier(model, feeds={"x": x}, atol=1e-4)
    assert strict.check(model, runner=runner(0.05), label="numpy", family="fusion")["passed"] is False
