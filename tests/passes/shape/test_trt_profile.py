"""set-trt-profile: validation against the model, storage in metadata, and read_profiles."""

from __future__ import annotations

import json

import onnx_ir as ir
import pytest
from mograph.passes.shape import METADATA_KEY, SetTrtProfilePass, read_profiles

from models import bert_tiny
from mograph.errors import OptionError
from mograph.testing import to_ir


def test_profiles_recorded_and_read_back():
    model = to_ir(bert_tiny(dynamic=True))
    assert read_profiles(model) == {}
    specs = ["input_ids:1x16,8x64,32x128", "attention_mask:1x16,8x64,32x128"]
    result = SetTrtProfilePass(profile=specs).call(model)
    assert result.modified and result.stats == {"profiles_set": 2, "profiles_total": 2}
    assert read_profiles(model) == {
        "input_ids": ((1, 16), (8, 64), (32, 128)),
        "attention_mask": ((1, 16), (8, 64), (32, 128)),
    }
    assert json.loads(model.metadata_props[METADATA_KEY])["input_ids"] == {"min": [1, 16], "opt": [8, 64], "max": [32, 128]}
    assert [n.op_type for n in model.graph] == [n.op_type for n in to_ir(bert_tiny(dynamic=True)).graph]
    # Survives serialisation, and reads from a ModelProto too.
    proto = ir.serde.serialize_model(model)
    assert read_profiles(proto)["input_ids"][2] == (32, 128)
    again = SetTrtProfilePass(profile=specs).call(model)
    assert not again.modified and again.stats == {"profiles_set": 0, "profiles_total": 2}


def test_new_profile_replaces_only_its_input():
    model = to_ir(bert_tiny(dynamic=True))
    SetTrtProfilePass(profile=["input_ids:1x16,8x64,32x128", "attention_mask:1x16,8x64,32x128"]).call(model)
    SetTrtProfilePass(profile=["input_ids:1x1,1x8,1x16"]).call(model)
    assert read_profiles(model)["input_ids"] == ((1, 1), (1, 8), (1, 16))
    assert read_profiles(model)["attention_mask"] == ((1, 16), (8, 64), (32, 128))


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("nope:1x16,1x16,1x16", "no input 'nope'"),
        ("input_ids:1x16,8x64", "exactly three shapes"),
        ("input_ids:8x16,1x64,32x128", "dimension 0: need min <= opt <= max"),
        ("input_ids:1x16x1,1x16x1,1x16x1", "rank 3"),
        ("input_ids:0x16,1x16,1x16", "dimension 0: size must be positive"),
    ],
)
def test_refusals(spec, words):
    with pytest.raises(OptionError, match=words):
        SetTrtProfilePass(profile=[spec]).call(to_ir(bert_tiny(dynamic=True)))


def test_static_dims_must_stay():
    model = to_ir(bert_tiny(dynamic=False, batch=1, seq=16))
    with pytest.raises(OptionError, match="input 'input_ids' dimension 1 must be 16"):
        SetTrtProfilePass(profile=["input_ids:1x8,1x16,1x16"]).call(model)
    assert SetTrtProfilePass(profile=["input_ids:1x16,1x16,1x16"]).call(model).modified
