"""The symbolic-dim algebra: one representation of "a size" for every shape reasoner in mograph.

A :class:`Dim` is an ordered product of factors: integers other than 1 and symbol names (``"batch"``,
``"=seq"``).  ``Dim()`` is the size 1.  It is a tuple, so dims compare, hash and print as their factors.

Order is kept on purpose.  A reshape is row-major: ``[batch * 16]`` read as ``(batch, 16)`` says that
batch is the outer factor, and where the factors land in a reshape target follows from that order (the
``make-dynamic`` pass relies on it).  Reasoners that only need "which size is this" use the
*normal form* (:meth:`Dim.normal`: the integer coefficient first, then the symbols sorted), in which
two products are equal exactly when they are equal for every value of their symbols.

Arithmetic (each exact, or ``None`` where the result is not a monomial of the same kind):

- :meth:`Dim.times` (ordered product) and :func:`mul` (normal product);
- :func:`div`: ``a / b`` when ``b`` divides ``a`` as monomials;
- :func:`add` / :func:`sub`: literals, or equal symbol sets whose coefficients add;
- :meth:`Dim.evaluate` under known facts (a size for each symbol), :func:`same_dim` under equality
  of normal forms, or of values under the facts when they are given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Union

__all__ = ["Dim", "Factor", "add", "div", "mul", "prod", "same_dim", "sub"]

#: One factor of a :class:`Dim`: an int (never 1 after canonicalisation) or a symbol name.
Factor = Union[int, str]


class Dim(tuple):  # type: ignore[type-arg]
    """A symbolic size: an ordered product of factors, adjacent ints merged and 1s dropped; ``Dim()`` is 1."""

    __slots__ = ()

    def __new__(cls, factors: Iterable[Factor] = ()) -> Dim:
        out: list[Factor] = []
        for f in factors:
            if isinstance(f, str):
                out.append(f)
            elif f != 1:
                if out and not isinstance(out[-1], str):
                    out[-1] = int(out[-1]) * int(f)
                else:
                    out.append(int(f))
        return super().__new__(cls, out)

    # --- constructors -----------------------------------------------------------------------
    @classmethod
    def lit(cls, n: int) -> Dim:
        """The literal size ``n`` (any int: 0 and negative entries of shape vectors included)."""
        n = int(n)  # what ``cls((n,))`` makes, without its loop: the shape query builds one per dim of every value
        return tuple.__new__(cls, () if n == 1 else (n,))

    @classmethod
    def sym(cls, name: str) -> Dim:
        """The size named ``name``."""
        return tuple.__new__(cls, (name,)) if isinstance(name, str) else cls((name,))

    # --- reading ----------------------------------------------------------------------------
    @property
    def has_sym(self) -> bool:
        """Whether any factor is a symbol (the size is not known as a number)."""
        for f in self:  # a loop, not ``any`` over a generator: asked of every dim the shape query sets
            if isinstance(f, str):
                return True
        return False

    @property
    def is_literal(self) -> bool:
        return not self.has_sym

    @property
    def value(self) -> int | None:
        """The number, for a literal; ``None`` when a symbol is a factor."""
        return None if self.has_sym else math.prod(self)  # type: ignore[arg-type]

    @property
    def coef(self) -> int:
        """The product of the integer factors."""
        return math.prod(f for f in self if not isinstance(f, str))

    @property
    def atoms(self) -> tuple[str, ...]:
        """The symbol factors, sorted."""
        return tuple(sorted(f for f in self if isinstance(f, str)))

    @property
    def symbol(self) -> str | None:
        """The name, when the dim is exactly one symbol (coefficient 1); else ``None``."""
        return self[0] if len(self) == 1 and isinstance(self[0], str) else None

    # --- algebra ----------------------------------------------------------------------------
    def normal(self) -> Dim:
        """The normal form: coefficient first, symbols sorted; a zero coefficient is the literal 0."""
        c = self.coef
        return Dim.lit(0) if c == 0 else Dim((c, *self.atoms))

    def times(self, other: Iterable[Factor]) -> Dim:
        """The ordered product ``self`` then ``other`` (row-major: ``self`` is the outer factor)."""
        return Dim((*self, *other))

    def evaluate(self, sizes: Mapping[str, int]) -> int:
        """The number this size is when each symbol has the size ``sizes`` gives it (a ``KeyError`` if not)."""
        return math.prod(sizes[f] if isinstance(f, str) else f for f in self)

    def __str__(self) -> str:
        return "*".join(str(f) for f in self) if self else "1"


def mul(a: Dim | None, b: Dim | None) -> Dim | None:
    """``a * b`` in normal form; ``None`` if either is unknown."""
    if a is None or b is None:
        return None
    return a.times(b).normal()


def prod(dims: Iterable[Dim | None]) -> Dim | None:
    """The normal product of ``dims``; ``None`` if any is unknown."""
    out: Dim | None = Dim()
    for d in dims:
        out = mul(out, d)
    return out


def div(a: Dim | None, b: Dim | None) -> Dim | None:
    """``a / b`` in normal form when ``b`` divides ``a`` exactly as a monomial; ``None`` otherwise."""
    if a is None or b is None or b.coef == 0:
        return None
    atoms = list(a.atoms)
    for atom in b.atoms:
        if atom not in atoms:
            return None
        atoms.remove(atom)
    if a.coef % b.coef:
        return None
    return Dim((a.coef // b.coef, *atoms)).normal()


def add(a: Dim | None, b: Dim | None) -> Dim | None:
    """``a + b`` when it is a monomial (both literal, ``b`` zero, or the same symbols); else ``None``."""
    return _combine(a, b, 1)


def sub(a: Dim | None, b: Dim | None) -> Dim | None:
    """``a - b`` when it is a monomial (both literal, ``b`` zero, or the same symbols); else ``None``."""
    return _combine(a, b, -1)


def _combine(a: Dim | None, b: Dim | None, sign: int) -> Dim | None:
    if a is None or b is None:
        return None
    if a.is_literal and b.is_literal:
        return Dim.lit(a.coef + sign * b.coef)
    if b == Dim.lit(0):
        return a
    if a.atoms == b.atoms:
        c = a.coef + sign * b.coef
        return Dim.lit(0) if c == 0 else Dim((c, *a.atoms))
    return None


def same_dim(a: Dim | None, b: Dim | None, sizes: Mapping[str, int] | None = None) -> bool:
    """Whether ``a`` and ``b`` are known to be the same size.

    Without ``sizes``: equal for every value of their symbols (equal normal forms).  With ``sizes`` (known
    facts: a number for each symbol), equal as numbers under those facts.
    """
    if a is None or b is None:
        return False
    if sizes is not None:
        return a.evaluate(sizes) == b.evaluate(sizes)
    return a.normal() == b.normal()
