"""autocast on Flax: linen Dense, Conv, LayerNorm, BatchNorm (mutable batch_stats), attention,
the benchmarks' transformer (jit and grad), and functions of NNX modules."""

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
from benchmarks.common import Block, TransformerStack, next_token_loss  # noqa: E402

from helpers import (BF16, F32, hlo_op_types, jaxpr_eqns, low_matmul, lowered_op_types,
                     rel_err)


def leaves_dtypes(tree):
    return {np.dtype(x.dtype) for x in jax.tree.leaves(tree)}


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x)
        x = nn.LayerNorm()(x.reshape(x.shape[0], -1))
        return nn.Dense(3)(x)


@pytest.fixture(scope="module")
def convnet():
    x = jax.random.normal(jax.random.key(1), (2, 6, 6, 2))
    model = ConvNet()
    variables = jax.jit(lambda x: model.init(jax.random.key(0), x, train=False))(x)
    return model, variables, x


def test_linen_conv_batchnorm_layernorm_dense(convnet, variant):
    model, variables, x = convnet
    apply = jamp.autocast(model.apply, device_type="cpu")
    out, updates = variant(lambda v, x: apply(v, x, train=True, mutable=["batch_stats"]))(
        variables, x)
    want, want_updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    assert out.dtype == F32 and rel_err(out, want) < 3e-2
    assert leaves_dtypes(updates) == {F32}
    for got, ref in zip(jax.tree.leaves(updates), jax.tree.leaves(want_updates)):
        assert rel_err(got, ref) < 3e-2
    text = jax.jit(lambda v, x: apply(v, x, train=True, mutable=["batch_stats"])).lower(
        variables, x).as_text()
    (conv,) = hlo_op_types(text, "convolution")
    assert low_matmul(conv, "bfloat16")
    (dot,) = hlo_op_types(text, "dot_general")
    assert low_matmul(dot, "bfloat16")


def test_linen_grads_close_to_fp32(convnet, variant):
    model, variables, x = convnet

    def loss(params, x):
        out, _ = model.apply({**variables, "params": params}, x, train=True,
                             mutable=["batch_stats"])
        return jnp.mean(out ** 2)

    got = variant(jax.grad(jamp.autocast(loss, device_type="cpu")))(variables["params"], x)
    want = jax.jit(jax.grad(loss))(variables["params"], x)  # the float32 reference
    assert leaves_dtypes(got) == {F32}
    for path_got, path_want in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        # The conv bias's true gradient is zero (BatchNorm removes it): only noise to compare.
        if np.linalg.norm(path_want) > 1e-4:
            assert rel_err(path_got, path_want) < 3e-2


def test_linen_attention(variant):
    attn = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
    x = jax.random.normal(jax.random.key(2), (2, 5, 8))
    variables = jax.jit(attn.init)(jax.random.key(0), x)
    f = jamp.autocast(attn.apply, device_type="cuda")
    out = variant(f)(variables, x)
    assert out.dtype == F32 and rel_err(out, attn.apply(variables, x)) < 3e-2
    text = jax.jit(f).lower(variables, x).as_text()
    dots = hlo_op_types(text, "dot_general")
    assert len(dots) == 6 and all(low_matmul(t, "float16") for t in dots)
    # The softmax's exp runs in float32 on the CUDA table (torch's list).
    assert hlo_op_types(text, "exponential") == [("float32",)]


@pytest.fixture(scope="module")
def transformer():
    model = TransformerStack(vocab=32, width=16, depth=2, num_heads=2)
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, 32)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]

    def loss_fn(params, tokens):
        return next_token_loss(model.apply({"params": params}, tokens), tokens)

    return loss_fn, params, tokens


def test_transformer_under_autocast_is_jittable_and_differentiable(transformer):
    loss_fn, params, tokens = transformer
    loss = jamp.autocast(loss_fn, dtype=jnp.bfloat16, device_type="cpu")
    step = jax.jit(jax.value_and_grad(loss))
    value, grads = step(params, tokens)
    want_value, want = jax.jit(jax.value_and_grad(loss_fn))(params, tokens)
    assert value.dtype == F32 and abs(float(value) - float(want_value)) < 3e-2 * float(want_value)
    assert leaves_dtypes(grads) == {F32}
    assert rel_err(jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)]),
                   jnp.concatenate([g.ravel() for g in jax.tree.leaves(want)])) < 3e-2
    text = jax.jit(jax.grad(loss)).lower(params, tokens).as_text()
    dots = hlo_op_types(text, "dot_general")
    assert dots and all(low_matmul(t, "bfloat16") for t in dots)


def test_transformer_matches_hand_written_bf16_dtypes(transformer):
    # The hand-written bfloat16 model (`dtype=jnp.bfloat16`) and autocast agree on where the
    # matmuls run, and autocast converts each weight once.
    loss_fn, params, tokens = transformer
    hand = TransformerStack(vocab=32, width=16, depth=2, num_heads=2, dtype=jnp.bfloat16)
    hand_loss = lambda p, t: next_token_loss(hand.apply({"params": p}, t), t)
    auto = jamp.autocast(loss_fn, dtype=jnp.bfloat16, device_type="cpu")
    count = lambda f: lowered_op_types(f, params, tokens, op="dot_general")
    assert len(count(auto)) == len(count(hand_loss))
    converts = [e for e in jaxpr_eqns(jax.make_jaxpr(auto)(params, tokens),
                                      "convert_element_type")
                if e.params["new_dtype"] == BF16 and len(e.invars[0].aval.shape) == 2
                and e.invars[0].aval.shape[0] == 16]
    weights_2d = [p for p in jax.tree.leaves(params) if p.ndim == 2 and p.shape[0] == 16]
    assert len(converts) == len(weights_2d)


class ScannedBlocks(nn.Module):
    """Blocks under nn.scan and nn.remat: scan, checkpoint and attention nested."""

    @nn.compact
    def __call__(self, x):
        class Step(nn.Module):
            @nn.compact
            def __call__(self, c, _):
                return Block(num_heads=2)(c), None

        x = nn.Dense(16)(x)
        x, _ = nn.scan(nn.remat(Step), variable_axes={"params": 0},
                       split_rngs={"params": True}, length=2)()(x, None)
        return x


def test_linen_scan_of_remat_blocks():
    model = ScannedBlocks()
    x = jax.random.normal(jax.random.key(5), (2, 4, 8))
    variables = jax.jit(model.init)(jax.random.key(0), x)
    loss = lambda v, x: jnp.mean(model.apply(v, x) ** 2)
    auto = jamp.autocast(loss, device_type="cpu")
    value, grads = jax.jit(jax.value_and_grad(auto))(variables, x)
    want_value, want = jax.jit(jax.value_and_grad(loss))(variables, x)
    assert abs(float(value) - float(want_value)) < 3e-2 * abs(float(want_value))
    flat = lambda t: jnp.concatenate([g.ravel() for g in jax.tree.leaves(t)])
    assert leaves_dtypes(grads) == {F32} and rel_err(flat(grads), flat(want)) < 3e-2
    dots = lowered_op_types(jax.grad(auto), variables, x, op="dot_general")
    assert dots and all(low_matmul(t, "bfloat16") for t in dots)


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.dense1 = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.dense2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.dense2(nnx.relu(self.bn(self.norm(self.dense1(x)))))


def test_nnx_function_of_a_module(variant):
    model = NNXMLP(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    x = jax.random.normal(jax.random.key(4), (3, 4))

    def forward(state, x):
        m = nnx.merge(graphdef, state)
        y = m(x)
        return y, nnx.state(m)

    f = jamp.autocast(forward, device_type="cpu")
    (out, new_state) = variant(f)(state, x)
    want, want_state = forward(state, x)
    assert out.dtype == F32 and rel_err(out, want) < 3e-2
    assert leaves_dtypes(nnx.state(new_state, nnx.BatchStat)) == {F32}
    dots = lowered_op_types(lambda s, x: f(s, x)[0], state, x, op="dot_general")
    assert len(dots) == 2 and all(low_matmul(t, "bfloat16") for t in dots)

    def loss(params, rest, x):
        m = nnx.merge(graphdef, params, rest)
        m.eval()    # running statistics: nothing to mutate under jax.grad
        return jnp.mean(m(x) ** 2)

    params, rest = state.split(nnx.Param, ...)
    grads = variant(jax.grad(jamp.autocast(loss, device_type="cpu")))(params, rest, x)
    want_grads = jax.jit(jax.grad(loss))(params, rest, x)
    assert leaves_dtypes(grads) == {F32}
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert rel_err(g, w) < 3e-2


def test_nnx_module_closed_over_inside_nnx_jit():
    # A module read (not mutated) by the transformed function can be closed over.
    model = NNXMLP(nnx.Rngs(0))
    model.eval()
    x = jax.random.normal(jax.random.key(4), (3, 4))

    @nnx.jit
    def run(model, x):
        return jamp.autocast(lambda x: model.dense1(x) @ model.dense2.kernel[...],
                             device_type="cpu",
                             cast_outputs=False)(x), jamp.autocast(model, device_type="cpu")(x)

    low, full = run(model, x)
    assert low.dtype == BF16 and full.dtype == F32
    assert rel_err(full, model(x)) < 3e-2
