"""The debugger on real models under jit, each with a planted float16 overflow in one module: a
Flax linen transformer (attention with a padding mask, LayerNorm) and an NNX CNN with
BatchNorm."""

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jamp
from jamp.debug import first_nonfinite, precision_report

F16 = dict(dtype=jnp.float16, device_type="cuda")


def _line_of(function, marker: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def _finite(tree) -> bool:
    return all(bool(np.all(np.isfinite(g))) for g in jax.tree_util.tree_leaves(tree))


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32)(nn.gelu(nn.Dense(64)(x * 1e5)))  # planted


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(
            nn.LayerNorm(name="ln1")(x), mask=mask)
        return x + Mlp(name="mlp")(nn.LayerNorm(name="ln2")(x))


class Transformer(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        mask = nn.make_attention_mask(tokens > 0, tokens > 0)
        x = nn.Embed(50, 32, name="embed")(tokens)
        x = Block(name="block")(x, mask)
        return nn.Dense(50, name="head")(nn.LayerNorm(name="ln_f")(x))


def _lm_loss(variables, tokens):
    logits = Transformer().apply(variables, tokens)
    labels = jax.nn.one_hot(jnp.roll(tokens, -1, axis=1), 50)
    weights = (tokens > 0).astype(jnp.float32)
    per_token = -jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1)
    return jnp.sum(per_token * weights) / jnp.sum(weights)


@pytest.fixture(scope="module")
def transformer():
    tokens = jax.random.randint(jax.random.key(0), (4, 12), 1, 50)
    tokens = tokens.at[:, 9:].set(0)  # padding
    variables = Transformer().init(jax.random.key(1), tokens)
    loss = jax.jit(_lm_loss)  # the report looks inside the jit
    return variables, tokens, loss, precision_report(loss, variables, tokens, **F16)


def test_transformer_report_names_the_mlp(transformer):
    _, _, _, report = transformer
    first = report.overflows[0]
    assert not first.backward and first.module.startswith("Transformer/block/mlp")
    assert first.location.endswith(f":{_line_of(Mlp.__call__, '# planted')}")
    assert report.rules_checked
    assert [p for p, _ in report.rules] and all(
        p.startswith("/Transformer/block/mlp") for p, _ in report.rules)


def test_transformer_rules_make_it_finite_under_jit(transformer):
    variables, tokens, loss, report = transformer
    fixed = jax.jit(jax.value_and_grad(jamp.autocast(loss, **F16, rules=report.rules)))
    value, grads = fixed(variables, tokens)
    reference = _lm_loss(variables, tokens)
    assert _finite(grads) and abs(value - reference) <= 1e-2 * abs(reference)
    assert first_nonfinite(loss, variables, tokens, **F16, rules=report.rules) is None
    found = first_nonfinite(loss, variables, tokens, **F16)
    assert found is not None and found.module.startswith("Transformer/block/mlp")


class Hot(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.linear(x * 1e5)  # planted


class ConvNet(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.hot = Hot(rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.bn(self.conv(x))).mean((1, 2))
        return self.head(jax.nn.relu(self.hot(h)) * 1e-5)


def _cnn_loss(model, x):
    return jnp.mean(model(x) ** 2)


def test_nnx_cnn_with_batchnorm():
    model = ConvNet(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (4, 6, 6, 1))
    report = precision_report(_cnn_loss, model, x, **F16)
    first = report.overflows[0]
    assert not first.backward and first.module.startswith("ConvNet/hot")
    assert first.location.endswith(f":{_line_of(Hot.__call__, '# planted')}")
    assert report.rules_checked and all(p.startswith("/ConvNet/hot") for p, _ in report.rules)
    reference = _cnn_loss(ConvNet(nnx.Rngs(0)), x)
    fixed = jamp.autocast(_cnn_loss, **F16, rules=report.rules)
    value, grads = nnx.jit(nnx.value_and_grad(fixed))(ConvNet(nnx.Rngs(0)), x)
    assert _finite(nnx.state(grads)) and abs(value - reference) <= 1e-2 * abs(reference)
