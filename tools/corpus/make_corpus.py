"""Build the exporter corpus: small transformer blocks written in each framework, exported by its own exporter.

Each framework lives in its own venv (``tools/corpus/setup_venv.sh``); run this script once per family
with that venv's python, then once more with ``manifest`` to merge what they wrote::

    bash tools/corpus/setup_venv.sh                       # .venv-corpus/{torch,tf,jax,paddle,jax2tf}
    for f in torch tf jax jax2tf paddle; do .venv-corpus/$f/bin/python tools/corpus/make_corpus.py $f; done
    .venv-corpus/torch/bin/python tools/corpus/make_corpus.py torch-plain  # norms without a residual, opsets 11-16
    .venv-corpus/jax2tf/bin/python tools/corpus/make_corpus.py jax2tf-plain  # flax, dynamic batch, no residual
    .venv-corpus/torch/bin/python tools/corpus/make_corpus.py fp16      # fp16 variants (onnxconverter-common)
    python tools/corpus/make_corpus.py manifest

or ``bash tools/corpus/make_all.sh``.  Output: ``tests/data/corpus/<name>.onnx`` and
``tests/data/corpus/manifest.json``, which says for every model the exporter, the versions that wrote it
and how many instances of each fused computation it holds **by construction** (counted from the code
below, not from any fusion): ``layernorm``, ``rmsnorm`` (each norm, whatever its input), ``skipnorm``
(the norms among those that read a residual ``Add``), ``gelu`` (exact, tanh, sigmoid and QuickGELU
alike).  A model with a ``limitation`` cannot be fused, for the reason given (float16 below opset 15:
the fused ops' function bodies need ``CastLike``); the test checks that ``--explain`` gives that reason.
Models named ``nearmiss_*`` hold computations that look like those but are not (a norm over
the wrong axis, epsilon outside the square root, a GELU with a wrong constant): zero instances.

The blocks (hidden 16, sequence 4, batch 2, random weights from a fixed seed)::

    post-LN (BERT)   s1 = x + attn(x);  h1 = LN(s1);  s2 = h1 + W2 gelu(W1 h1 + b1) + b2;  y = LN(s2)
    pre-RMS (LLaMA)  s1 = x + W_o RMS(x);  y = RMS(s1) * W ...  (two RMSNorms, one reading a residual)

Every export keeps float32 weights as initializers and static shapes (a static hidden size is what lets
``ReduceSum / N`` be proved a mean).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "corpus"
B, S, H, F = 2, 4, 16, 32
EPS = 1e-5


def _write_part(family: str, entries: list[dict]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f".part-{family}.json").write_text(json.dumps(entries, indent=1))


def _counts(layernorm: int = 0, rmsnorm: int = 0, skipnorm: int = 0, gelu: int = 0) -> dict[str, int]:
    return {"layernorm": layernorm, "rmsnorm": rmsnorm, "skipnorm": skipnorm, "gelu": gelu}


# Instances per block kind (by construction, see the docstring).
POST_LN = _counts(layernorm=2, skipnorm=2, gelu=1)
PRE_RMS = _counts(rmsnorm=2, skipnorm=1)
NEAR = _counts()


def _entry(name: str, exporter: str, versions: dict[str, str], opset: int, counts: dict[str, int], **extra: object) -> dict:
    return {"file": f"{name}.onnx", "exporter": exporter, "versions": versions, "opset": opset,
            "instances": counts, **extra}


def _opset_of(path: Path) -> int:
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    return max(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))


# ---------------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------------


def torch_family(plain_only: bool = False) -> None:
    """The torch blocks (TorchScript and dynamo exports); ``plain_only``: only the ``torch_ts*_plain-*``
    models (family ``torch-plain``), so adding them does not remake the rest."""
    import onnx
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)

    def gelu(kind: str, v: torch.Tensor) -> torch.Tensor:
        if kind == "erf":
            return nn.functional.gelu(v)
        if kind == "tanh":
            return nn.functional.gelu(v, approximate="tanh")
        if kind == "tanh-hand":  # the HF "NewGELU" spelling, x**3 written as a power
            return 0.5 * v * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * torch.pow(v, 3.0))))
        if kind == "quick":
            return v * torch.sigmoid(1.702 * v)
        if kind == "wrong-const":  # near miss: 0.5 x (1 + tanh(0.9 (x + 0.044715 x^3)))
            return 0.5 * v * (1.0 + torch.tanh(0.9 * (v + 0.044715 * v * v * v)))
        raise ValueError(kind)

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(H, 3 * H)
            self.o = nn.Linear(H, H)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(H), dim=-1)
            return self.o(p @ v)

    class HandLN(nn.Module):  # LayerNorm written out (mean, centred variance, rsqrt)
        def __init__(self, axis: int = -1, eps_outside: bool = False) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.rand(H) + 0.5)
            self.b = nn.Parameter(torch.rand(H) - 0.5)
            self.axis, self.eps_outside = axis, eps_outside

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            m = x.mean(self.axis, keepdim=True)
            d = x - m
            var = (d * d).mean(self.axis, keepdim=True)
            if self.eps_outside:  # near miss: eps added after the square root, eps large enough to matter
                y = d / (torch.sqrt(var) + 0.1)
            else:
                y = d * torch.rsqrt(var + EPS)
            return y * self.w + self.b

    class RMS(nn.Module):  # LLaMA's RMSNorm
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.rand(H) + 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    class PostLN(nn.Module):
        def __init__(self, act: str, hand: bool = False) -> None:
            super().__init__()
            self.attn = Attn()
            self.ln1 = HandLN() if hand else nn.LayerNorm(H, eps=EPS)
            self.ln2 = HandLN() if hand else nn.LayerNorm(H, eps=EPS)
            self.fc1, self.fc2 = nn.Linear(H, F), nn.Linear(F, H)
            self.act = act
            with torch.no_grad():
                for ln in (self.ln1, self.ln2):
                    if isinstance(ln, nn.LayerNorm):
                        ln.weight.uniform_(0.5, 1.5)
                        ln.bias.uniform_(-0.5, 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln1(x + self.attn(x))
            return self.ln2(h + self.fc2(gelu(self.act, self.fc1(h))))

    class PreRMS(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = RMS(), RMS()
            self.o = nn.Linear(H, H, bias=False)
            self.head = nn.Linear(H, H, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = x + self.o(self.n1(x))
            return self.head(self.n2(s))

    class NearMiss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = HandLN(axis=1)  # over the sequence axis
            self.b = HandLN(eps_outside=True)
            self.fc = nn.Linear(H, H)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.fc(gelu("wrong-const", self.a(x))))

    versions = {"torch": torch.__version__, "onnx": onnx.__version__}
    try:
        import onnxscript

        versions["onnxscript"] = onnxscript.__version__
    except ImportError:
        pass
    x = torch.randn(B, S, H)
    entries = []

    def export(model: nn.Module, name: str, exporter: str, opset: int, counts: dict[str, int]) -> None:
        path = OUT / f"{name}.onnx"
        model.eval()
        if exporter == "torchscript":
            torch.onnx.export(model, (x,), str(path), opset_version=opset, dynamo=False, input_names=["x"],
                              output_names=["y"], do_constant_folding=True)
        else:
            prog = torch.onnx.export(model, (x,), dynamo=True, opset_version=opset, input_names=["x"],
                                     output_names=["y"], optimize=True)
            prog.save(str(path), external_data=False)
        entries.append(_entry(name, f"torch-{exporter}", versions, _opset_of(path), counts))
        print("wrote", path)

    blocks = {"ln-erf": (lambda: PostLN("erf"), POST_LN), "ln-tanh": (lambda: PostLN("tanh"), POST_LN),
              "rms": (PreRMS, PRE_RMS)}
    for opset in () if plain_only else (11, 14, 17):
        for kind, (make, counts) in blocks.items():
            export(make(), f"torch_ts{opset}_{kind}", "torchscript", opset, counts)
    if not plain_only:
        for opset in (18, 23):
            for kind, (make, counts) in blocks.items():
                export(make(), f"torch_dynamo{opset}_{kind}", "dynamo", opset, counts)
        export(PostLN("quick", hand=True), "torch_ts14_handln-quick", "torchscript", 14, POST_LN)
        export(PostLN("tanh-hand", hand=True), "torch_dynamo18_handln-tanh", "dynamo", 18, POST_LN)
        export(NearMiss(), "nearmiss_torch_ts14", "torchscript", 14, NEAR)
        export(NearMiss(), "nearmiss_torch_dynamo18", "dynamo", 18, NEAR)
        _write_part("torch", entries)

    # Norms without a residual below opset 17 (no standard LayerNormalization there): what each target's
    # lowering writes must pass the output check and run (issue 27), for every fused op kind.
    entries = []

    class Plain(nn.Module):  # y = N2(W2 act(W1 N1(x) + b1) + b2): no residual Add anywhere
        def __init__(self, norm: str, act: str) -> None:
            super().__init__()
            self.n1, self.n2 = (RMS(), RMS()) if norm == "rms" else (nn.LayerNorm(H, eps=EPS), nn.LayerNorm(H, eps=EPS))
            self.fc1, self.fc2 = nn.Linear(H, F), nn.Linear(F, H)
            self.act = act
            with torch.no_grad():
                for n in (self.n1, self.n2):
                    if isinstance(n, nn.LayerNorm):
                        n.weight.uniform_(0.5, 1.5)
                        n.bias.uniform_(-0.5, 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.n2(self.fc2(gelu(self.act, self.fc1(self.n1(x)))))

    plain = {"plain-ln-erf": ("ln", "erf", _counts(layernorm=2, gelu=1)),
             "plain-ln-tanh": ("ln", "tanh", _counts(layernorm=2, gelu=1)),
             "plain-rms-quick": ("rms", "quick", _counts(rmsnorm=2, gelu=1))}
    for opset in range(11, 17):
        for kind, (norm, act, counts) in plain.items():
            export(Plain(norm, act), f"torch_ts{opset}_{kind}", "torchscript", opset, counts)
    _write_part("torch-plain", entries)


# ---------------------------------------------------------------------------------------------
# TensorFlow / Keras 3 (tf2onnx), and JAX through jax2tf + tf2onnx
# ---------------------------------------------------------------------------------------------


def tf_family() -> None:
    import numpy as np
    import tensorflow as tf
    import tf2onnx

    os.environ["KERAS_BACKEND"] = "tensorflow"
    import keras

    keras.utils.set_random_seed(0)
    versions = {"tensorflow": tf.__version__, "keras": keras.__version__, "tf2onnx": tf2onnx.__version__}
    entries = []
    spec = (tf.TensorSpec((B, S, H), tf.float32, name="x"),)

    def save(fn, name: str, opset: int, counts: dict[str, int], exporter: str, vers: dict[str, str]) -> None:
        path = OUT / f"{name}.onnx"
        tf2onnx.convert.from_function(fn, input_signature=spec, opset=opset, output_path=str(path))
        entries.append(_entry(name, exporter, vers, _opset_of(path), counts))
        print("wrote", path)

    def keras_block(approximate: bool | None) -> keras.Model:
        inp = keras.Input((S, H), batch_size=B)
        att = keras.layers.MultiHeadAttention(num_heads=1, key_dim=H)(inp, inp)
        h = keras.layers.LayerNormalization(epsilon=EPS, beta_initializer="random_uniform",
                                            gamma_initializer="random_uniform")(inp + att)
        f = keras.layers.Dense(F)(h)
        f = keras.activations.gelu(f, approximate=bool(approximate))
        f = keras.layers.Dense(H)(f)
        y = keras.layers.LayerNormalization(epsilon=EPS, beta_initializer="random_uniform",
                                            gamma_initializer="random_uniform")(h + f)
        return keras.Model(inp, y)

    def keras_rms(make_norm) -> keras.Model:  # type: ignore[no-untyped-def]
        inp = keras.Input((S, H), batch_size=B)
        s = inp + keras.layers.Dense(H, use_bias=False)(make_norm()(inp))
        return keras.Model(inp, keras.layers.Dense(H, use_bias=False)(make_norm()(s)))

    for opset in (13, 17):
        # keras.activations.gelu(approximate=False) is written by tf2onnx 1.17 as ``Erfc``, which is no
        # ONNX op (ONNX Runtime refuses the model): those exports are not in the corpus.
        for tag, approx in (("tanh", True),):
            model = keras_block(approx)
            save(tf.function(lambda x, m=model: m(x)), f"keras_tf2onnx{opset}_ln-{tag}", opset, POST_LN,
                 "keras3-tf2onnx", versions)
        model = keras_rms(lambda: keras.layers.RMSNormalization(epsilon=1e-6))
        save(tf.function(lambda x, m=model: m(x)), f"keras_tf2onnx{opset}_rms", opset, PRE_RMS, "keras3-tf2onnx",
             versions)
    # Keras' LayerNormalization(rms_scaling=True) computes x / sqrt(Var[x] + eps) * gamma: the variance is
    # centred but x is not, so it is neither a LayerNorm nor an RMSNorm -- a near miss by construction.
    model = keras_rms(lambda: keras.layers.LayerNormalization(epsilon=1e-6, rms_scaling=True,
                                                              gamma_initializer="random_uniform"))
    save(tf.function(lambda x, m=model: m(x)), "nearmiss_keras_rms_scaling", 17, NEAR, "keras3-tf2onnx", versions)

    del np
    _write_part("tf", entries)


def jax2tf_family(plain_only: bool = False) -> None:
    """Flax -> jax2tf (graph serialization, no XLA ops; with_gradient=False would add PreventGradient,
    which tf2onnx cannot convert) -> tf2onnx: the path of JAX models on TF serving.

    Current JAX serializes natively only (one ``XlaCallModule`` op holding StableHLO, which tf2onnx cannot
    convert), so this family runs in a venv of the last JAX with graph serialization (setup_venv.sh jax2tf).
    """
    import flax
    import jax
    import tensorflow as tf
    import tf2onnx
    from jax.experimental import jax2tf

    versions = {"jax": jax.__version__, "flax": flax.__version__, "tensorflow": tf.__version__,
                "tf2onnx": tf2onnx.__version__}
    spec = (tf.TensorSpec((B, S, H), tf.float32, name="x"),)
    entries = []
    for kind, (module, counts) in ({} if plain_only else _flax_blocks()).items():
        fn = module()
        tf_fn = tf.function(jax2tf.convert(fn, with_gradient=True, native_serialization=False, enable_xla=False),
                            autograph=False)
        for opset in (13, 17):
            name = f"jax2tf_tf2onnx{opset}_{kind}"
            path = OUT / f"{name}.onnx"
            tf2onnx.convert.from_function(tf_fn, input_signature=spec, opset=opset, output_path=str(path))
            entries.append(_entry(name, "jax2tf-tf2onnx", versions, _opset_of(path), counts))
            print("wrote", path)
    if not plain_only:
        _write_part("jax2tf", entries)
        return

    # A dynamic batch dim (jax2tf polymorphic_shapes): the kept dims of the sum-based mean and the
    # E[x^2] - E[x]^2 variance come back through Reshape/Expand to Concat(Slice(Shape(x)), ..), shapes
    # inference cannot follow (issue 27).  No residual: the norms read the input and a Dense.
    entries = []
    dyn = (tf.TensorSpec((None, S, H), tf.float32, name="x"),)
    for kind, (module, counts) in _flax_plain_blocks().items():
        fn = module()
        tf_fn = tf.function(jax2tf.convert(fn, with_gradient=True, native_serialization=False, enable_xla=False,
                                           polymorphic_shapes=[f"(b, {S}, {H})"]), autograph=False)
        for opset in (13, 17):
            name = f"jax2tf_tf2onnx{opset}_dyn-{kind}"
            path = OUT / f"{name}.onnx"
            tf2onnx.convert.from_function(tf_fn, input_signature=dyn, opset=opset, output_path=str(path))
            entries.append(_entry(name, "jax2tf-tf2onnx", versions, _opset_of(path), counts, dynamic_batch=True))
            print("wrote", path)
    _write_part("jax2tf-plain", entries)


def _flax_plain_blocks() -> dict:
    """Flax blocks without a residual, each norm spelled one way: ``nn.LayerNorm`` (E[x^2] - E[x]^2
    clamped by max(., 0)), ``use_fast_variance=False`` (centred variance), a hand-written LayerNorm
    (a sum / N mean, E[x^2] - E[x]^2 without the clamp, ``lax.rsqrt``) and ``nn.RMSNorm``."""
    import jax
    import jax.numpy as jnp
    from flax import linen as nn

    def init_ln() -> dict:
        return {"scale_init": jax.nn.initializers.uniform(1.0), "bias_init": jax.nn.initializers.normal(0.3)}

    class HandLN(nn.Module):
        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            g = self.param("scale", jax.nn.initializers.uniform(1.0), (H,))
            b = self.param("bias", jax.nn.initializers.normal(0.3), (H,))
            m = jnp.sum(x, axis=-1) / H
            v = jnp.mean(x * x, axis=-1) - m * m
            return (x - m[..., None]) * jax.lax.rsqrt(v[..., None] + EPS) * g + b

    class Plain(nn.Module):
        norm: str

        def make(self):  # type: ignore[no-untyped-def]
            if self.norm == "ln":
                return nn.LayerNorm(epsilon=EPS, **init_ln())
            if self.norm == "ln-centred":
                return nn.LayerNorm(epsilon=EPS, use_fast_variance=False, **init_ln())
            if self.norm == "rms":
                return nn.RMSNorm(epsilon=1e-6, scale_init=jax.nn.initializers.uniform(1.0))
            return HandLN()

        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            h = nn.Dense(H)(nn.gelu(nn.Dense(F)(self.make()(x)), approximate=False))
            return self.make()(h)

    def bind(mod):  # type: ignore[no-untyped-def]
        def make():  # type: ignore[no-untyped-def]
            x = jnp.ones((B, S, H), jnp.float32)
            params = mod.init(jax.random.PRNGKey(0), x)
            return lambda v: mod.apply(params, v)

        return make

    ln = _counts(layernorm=2, gelu=1)
    return {"ln": (bind(Plain("ln")), ln), "ln-centred": (bind(Plain("ln-centred")), ln),
            "handln": (bind(Plain("hand")), ln), "rms": (bind(Plain("rms")), _counts(rmsnorm=2, gelu=1))}


# ---------------------------------------------------------------------------------------------
# JAX / Flax through jax2onnx
# ---------------------------------------------------------------------------------------------


def _flax_blocks() -> dict:
    """Flax linen blocks as pure functions of x (weights closed over)."""
    import jax
    import jax.numpy as jnp
    from flax import linen as nn

    class Attn(nn.Module):
        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            q, k, v = jnp.split(nn.Dense(3 * H)(x), 3, axis=-1)
            p = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / math.sqrt(H), axis=-1)
            return nn.Dense(H)(p @ v)

    def init_ln() -> dict:
        return {"scale_init": jax.nn.initializers.uniform(1.0), "bias_init": jax.nn.initializers.normal(0.3)}

    class PostLN(nn.Module):
        approximate: bool

        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            h = nn.LayerNorm(epsilon=EPS, **init_ln())(x + Attn()(x))
            f = nn.Dense(H)(nn.gelu(nn.Dense(F)(h), approximate=self.approximate))
            return nn.LayerNorm(epsilon=EPS, **init_ln())(h + f)

    class PreRMS(nn.Module):
        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            ri = {"scale_init": jax.nn.initializers.uniform(1.0)}
            s = x + nn.Dense(H, use_bias=False)(nn.RMSNorm(epsilon=1e-6, **ri)(x))
            return nn.Dense(H, use_bias=False)(nn.RMSNorm(epsilon=1e-6, **ri)(s))

    def bind(mod):  # type: ignore[no-untyped-def]
        def make():  # type: ignore[no-untyped-def]
            x = jnp.ones((B, S, H), jnp.float32)
            params = mod.init(jax.random.PRNGKey(0), x)
            return lambda v: mod.apply(params, v)

        return make

    return {"ln-erf": (bind(PostLN(approximate=False)), POST_LN), "ln-tanh": (bind(PostLN(approximate=True)), POST_LN),
            "rms": (bind(PreRMS()), PRE_RMS)}


def jax_family() -> None:
    import flax
    import jax
    import jax2onnx

    versions = {"jax": jax.__version__, "flax": flax.__version__,
                "jax2onnx": getattr(jax2onnx, "__version__", _dist_version("jax2onnx"))}
    entries = []
    for kind, (make, counts) in _flax_blocks().items():
        fn = make()
        for opset, mode in ((18, "force_decomposed"), (23, "force_decomposed"), (23, "auto")):
            name = f"flax_jax2onnx{opset}_{kind}" + ("_native" if mode == "auto" else "")
            path = OUT / f"{name}.onnx"
            jax2onnx.to_onnx(fn, [(B, S, H)], opset=opset, normalization_mode=mode, return_mode="file",
                             output_path=str(path), input_names=["x"])
            entries.append(_entry(name, "flax-jax2onnx", versions, _opset_of(path), counts, normalization_mode=mode))
            print("wrote", path)
    _write_part("jax", entries)


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# ---------------------------------------------------------------------------------------------
# PaddlePaddle through paddle2onnx
# ---------------------------------------------------------------------------------------------


def paddle_family() -> None:
    import paddle
    import paddle2onnx
    from paddle import nn

    paddle.seed(0)
    versions = {"paddlepaddle": paddle.__version__, "paddle2onnx": paddle2onnx.__version__}
    entries = []

    class PostLN(nn.Layer):
        def __init__(self, approximate: bool) -> None:
            super().__init__()
            self.qkv, self.o = nn.Linear(H, 3 * H), nn.Linear(H, H)
            self.ln1, self.ln2 = nn.LayerNorm(H, epsilon=EPS), nn.LayerNorm(H, epsilon=EPS)
            for ln in (self.ln1, self.ln2):
                ln.weight.set_value(paddle.rand([H]) + 0.5)
                ln.bias.set_value(paddle.rand([H]) - 0.5)
            self.fc1, self.fc2 = nn.Linear(H, F), nn.Linear(F, H)
            self.approximate = approximate

        def forward(self, x):  # type: ignore[no-untyped-def]
            q, k, v = paddle.split(self.qkv(x), 3, axis=-1)
            p = nn.functional.softmax(paddle.matmul(q, k, transpose_y=True) / math.sqrt(H), axis=-1)
            h = self.ln1(x + self.o(paddle.matmul(p, v)))
            f = self.fc2(nn.functional.gelu(self.fc1(h), approximate=self.approximate))
            return self.ln2(h + f)

    class RMS(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.w = self.create_parameter([H], default_initializer=nn.initializer.Uniform(0.5, 1.5))

        def forward(self, x):  # type: ignore[no-untyped-def]
            return x * paddle.rsqrt(paddle.mean(x * x, axis=-1, keepdim=True) + 1e-6) * self.w

    class PreRMS(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = RMS(), RMS()
            self.o, self.head = nn.Linear(H, H, bias_attr=False), nn.Linear(H, H, bias_attr=False)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.head(self.n2(x + self.o(self.n1(x))))

    spec = [paddle.static.InputSpec([B, S, H], "float32", "x")]
    for kind, (make, counts) in {"ln-erf": (lambda: PostLN(False), POST_LN), "ln-tanh": (lambda: PostLN(True), POST_LN),
                                 "rms": (PreRMS, PRE_RMS)}.items():
        for opset in (11, 17):
            name = f"paddle_p2o{opset}_{kind}"
            layer = make()
            layer.eval()
            stem = OUT / name
            paddle.onnx.export(layer, str(stem), input_spec=spec, opset_version=opset)
            entries.append(_entry(name, "paddle2onnx", versions, _opset_of(OUT / f"{name}.onnx"), counts))
            print("wrote", stem)
    _write_part("paddle", entries)


# ---------------------------------------------------------------------------------------------
# fp16 variants (onnxconverter-common) and the manifest
# ---------------------------------------------------------------------------------------------

FP16_FROM = ("torch_ts14_ln-erf", "torch_ts17_ln-tanh", "torch_ts17_rms", "torch_dynamo18_ln-erf",
             "keras_tf2onnx17_ln-tanh", "keras_tf2onnx17_rms", "jax2tf_tf2onnx17_ln-erf", "flax_jax2onnx23_ln-tanh", "paddle_p2o17_ln-erf")


def fp16_family() -> None:
    import onnx
    import onnxconverter_common
    from onnxconverter_common import float16

    entries = []
    for part in sorted(OUT.glob(".part-*.json")):
        if part.name == ".part-fp16.json":
            continue
        for e in json.loads(part.read_text()):
            if not e.get("file"):
                continue
            stem = e["file"][:-5]
            if stem not in FP16_FROM:
                continue
            model = onnx.load(str(OUT / e["file"]))
            for keep_io in (False, True):
                half = float16.convert_float_to_float16(model, keep_io_types=keep_io)
                name = f"{stem}_fp16" + ("_keepio" if keep_io else "")
                onnx.save(half, str(OUT / f"{name}.onnx"))
                versions = {**e["versions"], "onnxconverter-common": onnxconverter_common.__version__}
                extra: dict[str, object] = {}
                if e["opset"] < 15:
                    extra["limitation"] = "needs opset >= 15"  # the fused ops' fp16 function bodies use CastLike
                entries.append(_entry(name, e["exporter"] + "+fp16", versions, e["opset"], e["instances"],
                                      fp16=True, keep_io_types=keep_io, source=e["file"], **extra))
                print("wrote", name)
    _write_part("fp16", entries)


#: What the corpus would hold but no exporter here writes as a valid model, and why.
NOT_EXPORTED = [
    {"exporter": "keras3-tf2onnx", "what": "keras.activations.gelu(approximate=False)",
     "why": "tf2onnx 1.17 writes TF's erfc as an 'Erfc' node, which is no ONNX op: ONNX Runtime refuses the model"},
    {"exporter": "jax2tf-tf2onnx", "what": "jax2tf with current JAX (0.10)",
     "why": "jax2tf serializes natively only (one XlaCallModule op holding StableHLO), which tf2onnx cannot "
            "convert; the corpus uses JAX 0.4.30's graph serialization instead (setup_venv.sh jax2tf)"},
]


def manifest() -> None:
    entries = []
    for part in sorted(OUT.glob(".part-*.json")):
        entries.extend(json.loads(part.read_text()))
    # Entries of the manifest already there whose family was not remade this time are kept.
    remade = {e["file"] for e in entries if e.get("file")}
    if (OUT / "manifest.json").exists():
        old = json.loads((OUT / "manifest.json").read_text())["models"]
        entries.extend(e for e in old if e["file"] not in remade and (OUT / e["file"]).exists())
    failed = NOT_EXPORTED + [e for e in entries if e.get("file") is None]
    entries = sorted((e for e in entries if e.get("file")), key=lambda e: e["file"])
    files = {e["file"] for e in entries}
    for path in OUT.glob("*.onnx"):
        if path.name not in files:
            print("not in any part (left out):", path.name)
    (OUT / "manifest.json").write_text(json.dumps({"models": entries, "not_exported": failed}, indent=1) + "\n")
    total = sum((OUT / e["file"]).stat().st_size for e in entries)
    print(f"manifest: {len(entries)} models, {total / 1e6:.2f} MB")


FAMILIES = {"torch": torch_family, "torch-plain": lambda: torch_family(plain_only=True),
            "jax2tf-plain": lambda: jax2tf_family(plain_only=True), "tf": tf_family, "jax": jax_family, "jax2tf": jax2tf_family,
            "paddle": paddle_family,
            "fp16": fp16_family, "manifest": manifest}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in FAMILIES:
        sys.exit(f"usage: make_corpus.py {{{'|'.join(FAMILIES)}}}")
    OUT.mkdir(parents=True, exist_ok=True)
    FAMILIES[sys.argv[1]]()
