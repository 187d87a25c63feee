"""The examples of docs/autocast.md run as written and do what the text says."""

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jamp

from helpers import BF16, F16, F32

DOC = pathlib.Path(__file__).parents[2] / "docs" / "autocast.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(3)(nn.relu(x))


@pytest.fixture
def ns(train_net):
    """A fresh namespace holding what the blocks name (a model, params, a batch...)."""
    return namespace(train_net)


def namespace(Net):
    x = jax.random.normal(jax.random.key(0), (6, 4))
    model = Classifier()
    variables = jax.jit(lambda x: model.init(jax.random.key(1), x))(x)

    def loss_fn(params, batch):
        return jnp.mean(model.apply({**variables, "params": params}, batch["x"]) ** 2)

    return dict(jax=jax, jnp=jnp, np=np, optax=optax, jamp=jamp, nnx=nnx, nn=nn, Net=Net,
                model=model, variables=variables, params=variables["params"], x=x,
                w=jnp.eye(4), batch={"x": x, "y": jnp.array([0, 1, 2, 0, 1, 2])},
                loss_fn=loss_fn)


def block_with(text):
    found = [b for b in BLOCKS if text in b]
    assert len(found) == 1, text
    return found[0]


def test_every_block_is_exercised():
    # Each block is picked out by a text that occurs in it alone, by a test of this file.
    picked = re.findall(r"block_with\((['\"])(.*?)\1\)", pathlib.Path(__file__).read_text())
    texts = [text.encode().decode("unicode_escape") for _, text in picked]
    assert sorted(BLOCKS.index(block_with(t)) for t in texts) == list(range(len(BLOCKS)))


def test_intro_block(ns):
    mlp = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)])
    ns.update(model=mlp, params=jax.jit(mlp.init)(jax.random.key(2), ns["x"])["params"])
    exec(block_with("softmax_cross_entropy_with_integer_labels"), ns)
    assert ns["value"].dtype == F32
    assert {g.dtype for g in jax.tree.leaves(ns["grads"])} == {F32}


def test_torch_call_forms_block(ns):
    exec(block_with('@jamp.autocast("cpu")'), ns)
    assert ns["forward"](ns["x"], ns["w"]).dtype == F32  # outputs back in the traced dtype
    assert ns["loss"](ns["params"], ns["batch"]).dtype == F32


def test_masked_softmax_block(ns):
    ns.update(q=jnp.ones((2, 4)), k=jnp.ones((2, 4)), mask=jnp.array([[1, 0], [0, 0]], bool))
    exec(block_with("def masked_softmax"), ns)
    np.testing.assert_allclose(ns["out"], [[1.0, 0.0], [0.5, 0.5]], atol=1e-6)


def test_table_block(ns):
    exec(block_with('.without("cumsum")'), ns)
    assert ns["table"].rule("logistic") == "fp32" and ns["table"].rule("cumsum") is None
    assert ns["loss"](ns["params"], ns["batch"]).dtype == F32


def test_primitive_names_block(ns):
    block = block_with("primitive_names(jax.nn.softmax")
    shown = eval(block.split("# ", 1)[1])
    assert eval(block.splitlines()[0], ns) == shown


def test_regions_block(ns):
    ns["x"] = ns["x"][:4]  # square, as `a @ c` needs
    exec(block_with("regions nest"), ns)
    assert ns["f"](ns["x"], ns["w"]).dtype == F32
    raw = jamp.autocast(ns["f"], device_type="cpu", cast_outputs=False)
    assert raw(ns["x"], ns["w"]).dtype == BF16


def test_linen_blocks(ns):
    exec(block_with("cast_outputs=False)(variables, x)"), ns)
    assert ns["logits"].dtype in (BF16, F16)
    exec(block_with("jamp.autocast(model.apply, dtype=jnp.bfloat16)"), ns)
    assert ns["logits"].dtype == F32
    assert {u.dtype for u in jax.tree.leaves(ns["updates"])} == {F32}


def test_precision_rules_blocks(ns):
    exec(block_with('("BatchNorm_*", jnp.float32)'), ns)
    dots = lambda fn, *args: [e.invars[0].aval.dtype for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns
                              if e.primitive.name == "dot_general"]
    assert dots(ns["ruled"], ns["weights"], ns["x"]) == [F16, F32]
    assert ns["stats"]["batch_stats"]["BatchNorm_0"]["mean"].dtype == F32
    exec(block_with('("blocks/1", jnp.float32)'), ns)
    assert ns["tower_out"].shape == (6, 4)
    ns["tower"].eval()  # BatchNorm's statistics are not updated inside make_jaxpr's trace
    low = jamp.policy.autocast_table(jax.default_backend()).default_dtype
    assert dots(ns["tower_forward"], ns["x"]) == [low, F32]


def test_nnx_state_block(ns):
    ns["x"] = jax.random.normal(jax.random.key(3), (16, 4)) + 1.0
    exec(block_with("nnx.value_and_grad(jamp.autocast(loss_fn))"), ns)
    model = ns["model"]
    assert not np.allclose(model.bn.mean[...], 0.0)
    assert int(model.dropout.rngs.count[...]) == 2  # value_and_grad, then forward
    assert ns["y"].dtype == F32


def test_nnx_functional_block(ns):
    ns["model"] = ns["Net"](nnx.Rngs(0, dropout=1))
    exec(block_with("nnx.split(model)"), ns)
    assert ns["y"].dtype == F32
    assert not np.allclose(ns["new_state"]["bn"]["mean"][...], 0.0)


def test_custom_vjp_block(ns):
    exec(block_with("fused.defvjp"), ns)
    fused = ns["fused"]
    # The fwd and bwd given to defvjp are jamp's wrappers around the ones written.
    assert fused.fwd.__wrapped__ is ns["fused_fwd"]
    assert fused.bwd.__wrapped__ is ns["fused_bwd"]
