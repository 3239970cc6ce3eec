"""The symbolic-dim algebra: canonical factors, normal form, exact arithmetic, equality under facts."""

from __future__ import annotations

import pytest

from mograph.shapes import Dim, add, div, mul, prod, same_dim, sub

B, S = Dim.sym("b"), Dim.sym("s")


@pytest.mark.parametrize(("factors", "expected"), [
    ((), ()),
    ((1,), ()),
    ((2, 3), (6,)),
    ((2, "b", 3), (2, "b", 3)),           # order kept: 2 is outer, 3 inner
    (("b", 1, 4, 2, "s"), ("b", 8, "s")),
    ((0,), (0,)),
    ((-1,), (-1,)),
])
def test_canonical_factors(factors: tuple, expected: tuple) -> None:
    assert Dim(factors) == expected


@pytest.mark.parametrize("n", [1, 0, -1, 2, 64, True, 3.0])
def test_literal_is_the_canonical_one_factor_dim(n: object) -> None:
    got = Dim.lit(n)  # type: ignore[arg-type]
    assert type(got) is Dim and got == Dim((int(n),))  # type: ignore[call-overload]
    assert got.is_literal and not got.has_sym


@pytest.mark.parametrize("name", ["b", "=seq", "?3:x:0"])
def test_symbol_is_the_one_factor_dim(name: str) -> None:
    got = Dim.sym(name)
    assert type(got) is Dim
    assert got == Dim((name,))
    assert tuple(got) == (name,)
    assert got.has_sym and not got.is_literal and got.symbol == name


@pytest.mark.parametrize(("dim", "value", "coef", "atoms", "symbol", "text"), [
    (Dim(), 1, 1, (), None, "1"),
    (Dim.lit(0), 0, 0, (), None, "0"),
    (B, None, 1, ("b",), "b", "b"),
    (Dim((2, "s", "b")), None, 2, ("b", "s"), None, "2*s*b"),
])
def test_reading(dim: Dim, value: int | None, coef: int, atoms: tuple, symbol: str | None, text: str) -> None:
    assert (dim.value, dim.coef, dim.atoms, dim.symbol, str(dim)) == (value, coef, atoms, symbol, text)
    assert dim.has_sym == (value is None) != dim.is_literal


def test_normal_form_and_ordered_product() -> None:
    assert Dim(("s", 2, "b")).normal() == (2, "b", "s")
    assert Dim((0, "b")).normal() == Dim.lit(0)
    assert B.times(S) == ("b", "s") and S.times(B) == ("s", "b")  # ordered: layout differs
    assert B.times(S) != S.times(B) and same_dim(B.times(S), S.times(B))  # ... the size does not


@pytest.mark.parametrize(("fn", "a", "b", "expected"), [
    (mul, Dim((2, "b")), Dim((3, "s")), (6, "b", "s")),
    (mul, B, Dim.lit(0), (0,)),
    (mul, B, None, None),
    (div, Dim((6, "b", "s")), Dim((3, "s")), (2, "b")),
    (div, Dim((6, "b")), Dim.lit(4), None),            # not exact
    (div, B, S, None),                                 # s does not divide b
    (div, B, Dim.lit(0), None),
    (add, Dim.lit(3), Dim.lit(4), (7,)),
    (add, B, Dim.lit(0), ("b",)),
    (add, B, Dim((2, "b")), (3, "b")),
    (add, B, S, None),                                 # b + s is no monomial
    (sub, B, B, (0,)),
    (sub, Dim.lit(3), Dim.lit(5), (-2,)),
    (sub, B, Dim.lit(1), None),
])
def test_arithmetic(fn, a: Dim | None, b: Dim | None, expected: tuple | None) -> None:
    assert fn(a, b) == expected


def test_prod_and_evaluate_under_facts() -> None:
    assert prod([B, Dim.lit(4), S]) == (4, "b", "s")
    assert prod([B, None]) is None
    assert Dim((2, "b", "s")).evaluate({"b": 3, "s": 5}) == 30
    assert same_dim(Dim((2, "b")), Dim.lit(6), {"b": 3}) and not same_dim(Dim((2, "b")), Dim.lit(6))
    assert not same_dim(B, None)
