"""Canonicalization before matching: algebraic rewrites that give exporters' spellings one form.

The fusion rules of ``fuse-layernorm``, ``fuse-rmsnorm`` and ``fuse-gelu`` match one spelling of each
computation, with alternatives for the spellings most exporters share (rsqrt as ``Div`` by ``Sqrt``,
``Reciprocal(Sqrt)``, ``Pow(., -0.5)`` or ``1 / Sqrt``; a mean as ``ReduceMean`` or ``ReduceSum`` by 1/N;
both variance forms; every association of ``0.5 x (1 + t)``; x³ in any grouping ...).  What is left, a
rewrite here puts into one of those forms first (each exact, or exact up to float rounding):

==========================  ===================================================  ==================
rule                        rewrite                                              numbers
==========================  ===================================================  ==================
``identity``                ``Identity(v)`` -> ``v``                             exact
``cast-noop``               ``Cast(v, to=dtype(v))`` -> ``v``; ``Cast(Cast(v))``  exact
                            that widens and narrows back -> ``v``
``cast-cse``                a second ``Cast(v, to=t)`` -> the first (the fp16   exact
                            converter casts a graph input once per reader)
``cast-island``             ``Cast(op(Cast(a, f32), c), to=f16)`` -> ``op(a, c)``  exact
                            for ``Max``/``Min``/``Neg``/``Abs``/``Relu`` (ops the
                            fp16 converter keeps in float32)
``neutral``                 ``v * 1``, ``v / 1``, ``v + 0``, ``v - 0`` -> ``v``  exact (-0 -> +0)
                            (a constant of ones or zeros that does not
                            broadcast ``v`` to a larger shape)
``sub``                     ``a + Neg(b)``, ``a + b * -1``, ``a - Neg(-b)`` ->   exact
                            ``a - b``
``global-average-pool``     ``GlobalAveragePool(x)`` of a rank-3 ``x`` ->        exact
                            ``ReduceMean(x, axes=[2], keepdims=1)``
``const-chain``             ``(a * c1) * c2`` -> ``a * (c1 c2)`` for single      rounding
                            constants, the inner product read once
``factor-norm``             ``x * s + (-m * s + b)`` -> ``(x - m) * r * g + b``  rounding
                            where ``s = r * g`` (``tf.nn.batch_normalization``'s
                            form of a LayerNorm, Keras/TF): the centring is
                            factored out
``scale-out``               ``a * (r * g)`` -> ``(a * r) * g`` for a constant    rounding
                            vector ``g`` (a scale multiplied into the rsqrt:
                            Keras' RMSNormalization, Flax), ``r * g`` read once
``expand-noop``             ``Expand(v, s)`` that leaves v's shape -> ``v``      exact
                            (``s`` constant, or computed from ``Shape`` as
                            below)
``keepdims``                ``Reshape(f(ReduceX(x, keepdims=0)), kept shape)``  exact
                            -> ``f(ReduceX(x, keepdims=1))`` for ``f``
                            elementwise with single constants (jax2tf: the
                            mean and variance reduced without kept dims, then
                            reshaped back); the kept shape may be computed
                            at run time (``Concat(Slice(Shape(x)), .., 1)``
                            with casts: a dynamic batch dim), when it is
                            provably x's dims with the last one 1
``cube``                    ``x * (x * (a * x))`` and every other product of    rounding
                            three x and constants -> ``Pow(x, 3) * a``
``fold-broadcast``          ``Reshape``/``Unsqueeze``/``Expand``/``Squeeze`` of  exact
                            a constant -> the constant (scale and bias written
                            in the normalized shape)
==========================  ===================================================  ==================

``fuse-attention`` names the layout rewrites of :mod:`._layout` besides (``unit-axes``, ``shape-unit-axes``,
``squeeze-reshape``, ``gemm-rows``, ``batched-matmul``, ``bias-split``, ``matmul-transpose``, ``einsum-matmul``:
Keras' ``MultiHeadAttention`` as tf2onnx writes it); a pass that asks for every rewrite (``True``) gets the
algebraic ones above only.

Each rewrite is a :class:`CanonRule` (``_base``): a name, the op types its root may be, and a rewrite
that returns the replacement or a :class:`Miss` saying why it does not apply (``Canonicalizer.why_not``
lists them per rule, for diagnostics).  The rules live by kind in ``_casts``, ``_algebra`` and
``_shapes`` (the dims they compare asked of the core's shape query, :attr:`Canonicalizer.shapes`); ``_rules``
orders them (``_layout`` holds the layout ones); ``_engine`` applies them and commits or undoes each edit.

Canonicalization changes nothing that no fusion uses.  Every rewrite is an edit that keeps what it
replaced: the replaced nodes stay in the graph, detached (no inputs, a private domain, so no rule
matches them), until the fusion rules have run.  Then each edit is **committed** if a fusion
consumed what it made (the replaced nodes are deleted), or **undone** otherwise (the replaced nodes
get their inputs back, their readers are wired back to them, and what the edit made is removed),
in reverse order, so a graph where nothing fused comes back exactly as it was.  An edit is also used when a
fused op reads what it made (an attention takes a projection as its input and leaves the split it traced through
to die); a producer that only two edits' roots read, deleted with the later edit kept, is put back for the
earlier one undone; dead producers are removed once every edit is resolved.
"""

from __future__ import annotations

from mograph.passes.fusion.canonicalize._base import Build, CanonRule, Miss
from mograph.passes.fusion.canonicalize._engine import Canonicalizer
from mograph.passes.fusion.canonicalize._rules import RULES

__all__ = ["RULES", "Build", "CanonRule", "Canonicalizer", "Miss"]
