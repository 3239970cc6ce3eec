"""One parser each for shapes, profiles and booleans (:mod:`mograph.specs`), used by every command and pass."""

from __future__ import annotations

import pytest

from mograph.errors import OptionError, UsageError
from mograph.specs import parse_bool, parse_profile, parse_profiles, parse_shape, parse_shapes


@pytest.mark.parametrize(("spec", "expected"), [
    ("input_ids:1x128", ("input_ids", (1, 128))),
    ("onnx::Flatten_0:2X3", ("onnx::Flatten_0", (2, 3))),  # the name may hold ':'; 'X' reads as 'x'
    ("flag:", ("flag", ())),  # a scalar
])
def test_shapes(spec, expected):
    assert parse_shape(spec) == expected


@pytest.mark.parametrize(("spec", "words"), [
    ("input_ids", "expected NAME:D1xD2"),
    ("x:0x4", "dimension 0: size must be positive, not 0"),
    ("x:2xa", "dimension 1: 'a' is not an integer"),
    ("x:-1x4", "size must be positive, not -1"),
])
def test_bad_shapes_name_the_dimension(spec, words):
    with pytest.raises(OptionError, match=words) as info:
        parse_shape(spec, "fix-shapes")
    assert str(info.value).startswith("fix-shapes: ")
    assert isinstance(info.value, UsageError)  # exit code 2


def test_two_shapes_for_one_input_are_refused():
    assert parse_shapes(["a:1x2", "a:1x2", "b:3"]) == {"a": (1, 2), "b": (3,)}
    with pytest.raises(OptionError, match="input 'a' given two shapes"):
        parse_shapes(["a:1x2", "a:2x2"])


@pytest.mark.parametrize(("spec", "expected"), [
    ("input_ids:1x16,8x128,32x512", ("input_ids", ((1, 16), (8, 128), (32, 512)))),
    ("onnx::Gather_0:2x4", ("onnx::Gather_0", ((2, 4), (2, 4), (2, 4)))),  # one shape: fixed
])
def test_profiles(spec, expected):
    assert parse_profile(spec) == expected


@pytest.mark.parametrize(("spec", "words"), [
    ("input_ids", "expected NAME:MIN,OPT,MAX"),
    ("x:1x2,3x4", "give three shapes MIN,OPT,MAX"),
    ("x:4x4,2x4,8x4", "dimension 0: need min <= opt <= max, got 4, 2, 8"),
    ("x:1x2,1x2x3,1x2", "differ in rank"),
    ("x:0x4", "size must be positive"),
    ("x:ax4", "'a' is not an integer"),
])
def test_bad_profiles(spec, words):
    with pytest.raises(OptionError, match=words):
        parse_profile(spec)


def test_a_fixed_profile_can_be_refused_and_two_profiles_for_one_input_are():
    with pytest.raises(OptionError, match="exactly three shapes MIN,OPT,MAX$"):
        parse_profile("x:2x4", "set-trt-profile", fixed_allowed=False)
    with pytest.raises(OptionError, match="input 'x' given two profiles"):
        parse_profiles(["x:1x4", "x:2x4"])


@pytest.mark.parametrize(("raw", "value"), [("yes", True), ("On", True), ("1", True), (True, True), ("no", False),
                                            ("OFF", False), ("0", False), (False, False), (0, False), (1, True)])
def test_booleans(raw, value):
    assert parse_bool(raw) is value


@pytest.mark.parametrize("raw", ["maybe", "", 2, "2"])
def test_bad_booleans(raw):
    with pytest.raises(ValueError, match="expected yes or no"):
        parse_bool(raw)
