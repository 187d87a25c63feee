"""autocast on the Flax models users train first: attention over padded batches, conv+BatchNorm,
Dense+LayerNorm (and GroupNorm, RMSNorm), in linen and NNX, on both tables; biases and the
activation memory they decide."""

import functools
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jamp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import TransformerStack, next_token_loss, residual_bytes  # noqa: E402

from helpers import (BF16, F16, F32, eqn_dtypes, hlo_op_types, jaxpr_eqns, low_matmul,
                     lowered_op_types, rel_err)

TABLES = [("cpu", BF16), ("cuda", F16)]
FINFO_MIN = float(np.finfo(np.float32).min)


# -- padded attention ------------------------------------------------------------------------

@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("fill", [np.finfo(np.float32).min, -1e9, -2.4e38])
def test_masked_softmax_fill_never_becomes_inf(device_type, fill, variant):
    # The reproduction: a fully masked row must give a uniform softmax, not NaN.
    f = lambda q, k, m: jax.nn.softmax(jnp.where(m, q @ k.T, fill), -1)
    q = k = jnp.ones((2, 4))
    mask = jnp.array([[1, 0], [0, 0]], bool)
    got = variant(jamp.autocast(f, device_type=device_type))(q, k, mask)
    np.testing.assert_allclose(got, [[1.0, 0.0], [0.5, 0.5]], atol=1e-6)


@pytest.mark.parametrize("device_type,dtype", TABLES)
def test_linen_attention_with_padding_mask_trains(device_type, dtype):
    attn = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    lengths = jnp.array([5, 0])  # the second sequence is all padding
    pad = jnp.arange(5)[None, :] < lengths[:, None]
    mask = nn.make_attention_mask(pad, pad)
    variables = jax.jit(attn.init)(jax.random.key(1), x, mask=mask)

    def loss(params, x, mask):
        return jnp.mean(attn.apply({"params": params}, x, mask=mask) ** 2)

    auto = jamp.autocast(loss, device_type=device_type)
    value, grads = jax.jit(jax.value_and_grad(auto))(variables["params"], x, mask)
    want, want_grads = jax.value_and_grad(loss)(variables["params"], x, mask)
    assert np.isfinite(value) and rel_err(value, want) < 3e-2
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    flat = lambda t: jnp.concatenate([g.ravel() for g in jax.tree.leaves(t)])
    assert rel_err(flat(grads), flat(want_grads)) < 5e-2
    # The matmuls still run in the low dtype: the fix is the constant, not the attention. The
    # softmax computes in float32 on both tables: torch's CPU softmax kernel computes in
    # float32 and rounds once, torch's CUDA list holds softmax.
    text = jax.jit(lambda *a: auto(*a)).lower(variables["params"], x, mask).as_text()
    dots = hlo_op_types(text, "dot_general")
    assert dots and all(low_matmul(t, dtype.name) for t in dots)
    assert hlo_op_types(text, "exponential") == [("float32",)]


ADDITIVE_MASKS = {
    # (batch, keys) -> an additive attention bias; row 1 is all padding.
    "(1 - mask) * finfo.min": lambda m: ((1.0 - m) * FINFO_MIN)[:, None, :],
    "where(mask, 0, finfo.min)": lambda m: jnp.where(m > 0, 0.0, FINFO_MIN)[:, None, :],
    "weak full-size finfo.min": lambda m: jnp.full((2, 4, 4), FINFO_MIN).at[0, :, :2].set(0.0),
    "(1 - mask) * -1e9 in a jitted helper": lambda m: jax.jit(
        lambda m: ((1.0 - m) * -1e9)[:, None, :])(m),
}


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_mask_fills_that_are_arrays_stay_finite(device_type, variant):
    # A closed-over weak scalar array as the fill, and a whole additive mask passed as an
    # argument to an unbatched score matmul (what per-example attention under vmap is).
    fill = jnp.asarray(FINFO_MIN)
    mask = jnp.array([[1, 0], [0, 0]], bool)
    q = k = jnp.ones((2, 4))
    where = jamp.autocast(lambda q, k, m: jax.nn.softmax(jnp.where(m, q @ k.T, fill), -1),
                          device_type=device_type)
    np.testing.assert_allclose(variant(where)(q, k, mask), [[1, 0], [0.5, 0.5]], atol=1e-6)
    bias = jnp.where(mask, 0.0, FINFO_MIN)
    added = jamp.autocast(lambda q, k, b: jax.nn.softmax(q @ k.T + b, -1),
                          device_type=device_type)
    np.testing.assert_allclose(variant(added)(q, k, bias), [[1, 0], [0.5, 0.5]], atol=1e-6)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_additive_attention_masks_stay_finite(device_type):
    # An additive mask is an activation, not a layer's bias: it promotes, as in torch.
    q = jax.random.normal(jax.random.key(0), (2, 4, 8))
    mask = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0]], jnp.float32)

    def attention(q, mask, make_bias):
        scores = jnp.einsum("btd,bsd->bts", q, q)
        return jnp.sum(jax.nn.softmax(scores + make_bias(mask), axis=-1) ** 2)

    for name, make_bias in ADDITIVE_MASKS.items():
        f = functools.partial(attention, make_bias=make_bias)
        value, grad = jax.jit(jax.value_and_grad(jamp.autocast(f, device_type=device_type)))(
            q, mask)
        assert np.isfinite(value) and np.isfinite(grad).all(), name
        assert rel_err(value, f(q, mask)) < 2e-2, name


def test_float32_chain_runs_through_nested_jits():
    # jnp.clip is a nested jit: on the cuda table the log after it takes its whole input chain
    # in float32, so 1 - 1e-7 is not rounded to 1 in float16 (log(0) = -inf otherwise).
    x = jax.random.normal(jax.random.key(0), (8, 16)) * 4.0
    w = jax.random.normal(jax.random.key(1), (16, 1)) * 4.0

    def bce(x, w):
        p = jnp.clip(jax.nn.sigmoid(x @ w), 1e-7, 1 - 1e-7)
        return -jnp.mean(jnp.log(1 - p))

    got = jax.jit(jamp.autocast(bce, device_type="cuda"))(x, w)
    assert np.isfinite(got) and rel_err(got, bce(x, w)) < 2e-2


def test_computed_overflow_stays_visible_and_big_constants_stay_exact(variant):
    # A value the program computes overflows float16 as it would in torch: the loss scaler
    # must see it. A big constant in arithmetic is not rounded: the op runs in float32.
    big = jnp.full((2, 4), 300.0)
    overflowing = jamp.autocast(lambda x, w: x @ w.T, device_type="cuda", cast_outputs=False)
    assert np.isinf(variant(overflowing)(big, big)).all()
    scaled = jamp.autocast(lambda x, w: (x @ w.T) * 1e5, device_type="cuda", cast_outputs=False)
    small = jnp.full((2, 4), 0.01)
    out = variant(scaled)(small, small)
    assert out.dtype == F32
    np.testing.assert_allclose(out, 40.0, rtol=1e-2)


# -- normalization statistics ----------------------------------------------------------------

def _stat_eqns(f, *args):
    """Where normalizations compute statistics: the reductions, the rsqrts, and every
    equation on values of the statistics' shape (mean of squares minus squared mean...)."""
    jaxpr = jax.make_jaxpr(f)(*args)
    rsqrts = jaxpr_eqns(jaxpr, "rsqrt")
    shapes = {tuple(e.invars[0].aval.shape) for e in rsqrts}
    stats = [e for e in jaxpr.jaxpr.eqns if e.outvars and e.primitive.name != "convert_element_type"
             and tuple(e.outvars[0].aval.shape) in shapes
             and jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating)]
    return jaxpr_eqns(jaxpr, "reduce_sum") + rsqrts + stats


class LinenNorm(nn.Module):
    norm: str

    @nn.compact
    def __call__(self, x):
        if self.norm in ("BatchNorm", "GroupNorm"):
            x = nn.Conv(8, (3, 3), use_bias=False)(x)
            norm = (nn.BatchNorm(use_running_average=False) if self.norm == "BatchNorm"
                    else nn.GroupNorm(num_groups=4))
        else:
            x = nn.Dense(8)(x)
            norm = getattr(nn, self.norm)()
        return norm(x)


class NNXNorm(nnx.Module):
    def __init__(self, norm: str, rngs):
        conv = norm in ("BatchNorm", "GroupNorm")
        self.layer = (nnx.Conv(4, 8, (3, 3), use_bias=False, rngs=rngs) if conv
                      else nnx.Linear(4, 8, rngs=rngs))
        self.norm = (nnx.BatchNorm(8, rngs=rngs) if norm == "BatchNorm"
                     else nnx.GroupNorm(8, num_groups=4, rngs=rngs) if norm == "GroupNorm"
                     else getattr(nnx, norm)(8, rngs=rngs))

    def __call__(self, x):
        return self.norm(self.layer(x))


NORMS = ["BatchNorm", "LayerNorm", "GroupNorm", "RMSNorm"]


def _norm_input(norm):
    shape = (4, 6, 6, 4) if norm in ("BatchNorm", "GroupNorm") else (16, 4)
    # Off-centre inputs: where low-precision statistics lose the most.
    return jax.random.normal(jax.random.key(2), shape) * 3.0 + 5.0


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("norm", NORMS)
def test_linen_norm_statistics_run_in_float32(norm, device_type):
    # Read from the program (values: see the next tests): every reduction and rsqrt of the
    # normalization is float32, though the Dense or Conv before it ran in the low dtype.
    model = LinenNorm(norm)
    x = _norm_input(norm)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    f = jamp.autocast(lambda v, x: model.apply(v, x, mutable=["batch_stats"]),
                      device_type=device_type)
    stats = _stat_eqns(f, variables, x)
    assert stats and all(set(eqn_dtypes(e)[1]) == {"float32"} for e in stats)
    assert all(set(eqn_dtypes(e)[0]) <= {"float32", "int32", "bool"} for e in stats)
    lowered = jaxpr_eqns(jax.make_jaxpr(f)(variables, x), "convert_element_type")
    assert any(e.params["new_dtype"] != F32 for e in lowered)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("norm", NORMS)
def test_nnx_norm_statistics_run_in_float32(norm, device_type):
    model = NNXNorm(norm, nnx.Rngs(0))
    x = _norm_input(norm)
    graphdef, state = nnx.split(model)

    def forward(state, x):
        m = nnx.merge(graphdef, state)
        return m(x), nnx.state(m)

    f = jamp.autocast(forward, device_type=device_type)
    stats = _stat_eqns(f, state, x)
    assert stats and all(set(eqn_dtypes(e)[1]) == {"float32"} for e in stats)
    assert all(set(eqn_dtypes(e)[0]) <= {"float32", "int32", "bool"} for e in stats)


class LayerThenNorm(nn.Module):
    """conv+BatchNorm (ResNet-style, no conv bias), conv+GroupNorm, Dense+LayerNorm/RMSNorm."""

    norm: str
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        if self.norm in ("BatchNorm", "GroupNorm"):
            x = nn.Conv(16, (3, 3), use_bias=False, dtype=self.dtype)(x)
            if self.norm == "BatchNorm":
                return nn.BatchNorm(use_running_average=False, dtype=self.dtype)(x)
            return nn.GroupNorm(num_groups=4, dtype=self.dtype)(x)
        x = nn.Dense(64, dtype=self.dtype)(x)
        return getattr(nn, self.norm)(dtype=self.dtype)(x)


@pytest.mark.parametrize("device_type,dtype", TABLES)
@pytest.mark.parametrize("norm", NORMS)
def test_norm_error_no_worse_than_hand_written_low_precision(norm, device_type, dtype):
    # Output and running statistics against float32, beside the same model written with
    # flax's dtype= in the table's low dtype (whose statistics flax computes in float32).
    x = jax.random.normal(jax.random.key(0), (8, 8, 8, 8)) * 3.0 + 1.0
    if norm in ("LayerNorm", "RMSNorm"):
        x = x.reshape(64, 64)
    model = LayerThenNorm(norm)
    variables = jax.jit(model.init)(jax.random.key(1), x)
    run = lambda m: jax.jit(lambda v, x: m.apply(v, x, mutable=["batch_stats"]))
    want, want_stats = run(model)(variables, x)
    # The hand-written model rounded where it is written: by default XLA may drop a rounding
    # to the low dtype that the next op widens again (excess precision), which autocast keeps
    # (as torch does).
    hand, hand_stats = run(LayerThenNorm(norm, dtype=dtype)).lower(variables, x).compile(
        compiler_options={"xla_allow_excess_precision": False})(variables, x)
    auto, auto_stats = jax.jit(jamp.autocast(
        lambda v, x: model.apply(v, x, mutable=["batch_stats"]),
        device_type=device_type))(variables, x)
    assert rel_err(auto, want) <= 1.02 * rel_err(hand, want)
    for a, h, w in zip(jax.tree.leaves(auto_stats), jax.tree.leaves(hand_stats),
                       jax.tree.leaves(want_stats)):
        # (The same float32 statistics; the two programs may sum them in another order.)
        assert a.dtype == F32 and rel_err(a, w) <= rel_err(h, w) * (1 + 1e-4)


# -- biases and activation memory ------------------------------------------------------------

@pytest.mark.parametrize("device_type,dtype", TABLES)
def test_dense_and_conv_biases_follow_the_matmul(device_type, dtype):
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Conv(4, (3, 3))(x)
            return nn.Dense(3)(jax.nn.gelu(h.reshape(h.shape[0], -1)))

    x = jnp.ones((2, 4, 4, 3))
    model = Net()
    variables = jax.jit(model.init)(jax.random.key(0), x)
    f = jamp.autocast(model.apply, device_type=device_type, cast_outputs=False)
    assert f(variables, x).dtype == dtype   # torch's linear returns the low dtype, bias included
    text = jax.jit(f).lower(variables, x).as_text()
    # Both bias adds are inside their layer's kernel: added to its float32 accumulator and
    # rounded once. gelu's two adds run in the low dtype on the cuda table, in float32 inside
    # its kernel on the cpu table (torch's CPU gelu); no other float32 add is left.
    adds = hlo_op_types(text, "add")
    float32_adds = 2 if device_type == "cuda" else 4
    assert [t for t in adds if t != (dtype.name,)] == [("float32",)] * float32_adds


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_saved_activations_close_to_hand_written_bf16(device_type):
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    loss = lambda model: (lambda p, t: next_token_loss(model.apply(p, t), t))
    f32 = TransformerStack(vocab=64, width=32, depth=2, num_heads=2)
    hand = TransformerStack(vocab=64, width=32, depth=2, num_heads=2, dtype=jnp.bfloat16)
    params = jax.jit(f32.init)(jax.random.key(0), tokens)
    auto = jamp.autocast(loss(f32), device_type=device_type, dtype=jnp.bfloat16)
    assert residual_bytes(auto, params, tokens) <= 1.15 * residual_bytes(loss(hand), params,
                                                                          tokens)


# -- NNX state -------------------------------------------------------------------------------

def _nnx_loss(model, x):
    return jnp.mean(model(x) ** 2)


NNX_CALLS = {
    "argument": lambda wrap, model, x: wrap(_nnx_loss)(model, x),
    "closed_over": lambda wrap, model, x: wrap(lambda x: _nnx_loss(model, x))(x),
    "value_and_grad": lambda wrap, model, x: nnx.value_and_grad(wrap(_nnx_loss))(model, x)[0],
    "value_and_grad_in_nnx_jit": lambda wrap, model, x: nnx.jit(
        lambda m, x: nnx.value_and_grad(wrap(_nnx_loss))(m, x)[0])(model, x),
    "closed_over_in_nnx_jit": lambda wrap, model, x: nnx.jit(
        lambda m, x: wrap(lambda x: _nnx_loss(m, x))(x))(model, x),
}


@pytest.mark.parametrize("how", sorted(NNX_CALLS))
def test_nnx_state_updates_are_kept(how, train_net):
    # Two steps with and without autocast, from the same initial state: the same BatchNorm
    # statistics (to rounding), the same Dropout RNG counts, hence the same masks.
    x = jax.random.normal(jax.random.key(0), (16, 4)) + 2.0
    step = NNX_CALLS[how]
    plain = train_net(nnx.Rngs(0, dropout=1))
    auto = train_net(nnx.Rngs(0, dropout=1))
    initial_mean = np.asarray(auto.bn.mean[...])
    for _ in range(2):
        want = step(lambda f: f, plain, x)
        got = step(lambda f: jamp.autocast(f, device_type="cpu"), auto, x)
        assert rel_err(got, want) < 2e-2
    assert not np.allclose(auto.bn.mean[...], initial_mean)
    assert rel_err(auto.bn.mean[...], plain.bn.mean[...]) < 1e-2
    assert rel_err(auto.bn.var[...], plain.bn.var[...]) < 1e-2
    assert int(auto.dropout.rngs.count[...]) == int(plain.dropout.rngs.count[...]) == 2


class ScannedStack(nnx.Module):
    """NNX's scan-over-layers idiom: stacked layers created with nnx.vmap, run with nnx.scan."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return nnx.Linear(8, 8, rngs=rngs)

        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(x, layer):
            return jax.nn.gelu(layer(x))

        return step(x, self.layers)


def test_closed_over_nnx_scan_over_layers():
    model = ScannedStack(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 8))
    forward = jamp.autocast(lambda x: model(x), device_type="cpu")
    want = model(x)
    assert rel_err(forward(x), want) < 2e-2
    assert rel_err(nnx.jit(lambda m, x: jamp.autocast(lambda x: m(x), device_type="cpu")(x))(
        model, x), want) < 2e-2
    # Differentiated from outside: plain JAX cannot even run the model here (NNX refuses a
    # closed-over scan inside jax.grad), so the reference takes it as an argument.
    grad = jax.grad(lambda x: jnp.sum(forward(x) ** 2))(x)
    want_grad = nnx.grad(lambda m, x: jnp.sum(m(x) ** 2), argnums=1)(model, x)
    assert rel_err(grad, want_grad) < 3e-2
    dots = lowered_op_types(forward, x, op="dot_general")
    assert dots and all(low_matmul(t, "bfloat16") for t in dots)
