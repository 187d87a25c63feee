"""Casting floating leaves over every pytree a Flax user holds, eagerly and under jit."""

from typing import NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import FrozenDict

from jamp.policy import cast_floating, cast_to_full, cast_to_half, get_policy

from helpers import BF16, F16, F32


class Batch(NamedTuple):
    images: jax.Array
    labels: jax.Array


@flax.struct.dataclass
class TrainState:
    params: dict
    step: jax.Array
    name: str = flax.struct.field(pytree_node=False, default="run")


def mixed_tree():
    """Floating, integer, bool, complex, non-array and numpy leaves, nested in Flax containers."""
    return {
        "frozen": FrozenDict({"kernel": jnp.ones((2, 3)), "count": jnp.arange(3)}),
        "state": TrainState(params={"bias": jnp.zeros(3, jnp.bfloat16)}, step=jnp.array(7)),
        "batch": Batch(images=np.ones((2, 2), np.float32), labels=np.array([1, 0])),
        "list": [jnp.array(1.5, jnp.float16), jnp.array([True, False]), 2.5, "tag", None],
        "complex": jnp.ones(2, jnp.complex64),
    }


def leaves_by_path(tree):
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("target", [BF16, F16, F32])
def test_only_floating_arrays_are_cast(target, variant):
    out = variant(lambda t: cast_floating(t, target))(mixed_tree()["frozen"])
    assert out["kernel"].dtype == target
    assert out["count"].dtype == jnp.int32
    assert isinstance(out, FrozenDict)


@pytest.mark.parametrize("target", [BF16, F16, F32])
def test_every_kind_of_leaf_and_container(target):
    # Eagerly only: strings and None are not leaves a jitted function can return.
    tree = mixed_tree()
    out = cast_floating(tree, target)
    assert out["frozen"]["kernel"].dtype == target and isinstance(out["frozen"], FrozenDict)
    assert out["state"].params["bias"].dtype == target
    assert out["state"].step.dtype == jnp.int32
    assert out["state"].name == "run"
    assert isinstance(out["batch"], Batch)
    assert isinstance(out["batch"].images, np.ndarray) and out["batch"].images.dtype == target
    assert out["batch"].labels.dtype == tree["batch"].labels.dtype
    assert out["list"][0].dtype == target
    assert out["list"][1].dtype == jnp.bool_
    assert out["list"][2:] == [2.5, "tag", None]
    assert out["complex"].dtype == jnp.complex64


def test_cast_values_round_as_astype():
    x = jnp.array([1.0, 1 / 3, 1e5, -2.0], jnp.float32)
    np.testing.assert_array_equal(cast_floating(x, jnp.float16), x.astype(jnp.float16))
    np.testing.assert_array_equal(cast_floating(x, jnp.bfloat16), x.astype(jnp.bfloat16))


def test_leaf_already_in_target_dtype_is_returned_as_is():
    x = jnp.ones(3, jnp.bfloat16)
    assert cast_floating({"x": x}, jnp.bfloat16)["x"] is x
    text = jax.jit(lambda t: cast_floating(t, jnp.bfloat16)).lower(x).as_text()
    assert "convert" not in text


def test_cast_under_jit_converts_in_the_lowered_program():
    policy = get_policy("p=f32,c=bf16,o=f32")
    params = {"w": jnp.ones((4, 4)), "n": jnp.arange(4)}
    text = jax.jit(policy.cast_to_compute).lower(params).as_text()
    assert "stablehlo.convert" in text and "tensor<4x4xbf16>" in text
    assert "tensor<4xbf16>" not in text  # the integer leaf is not converted


def test_linen_variables(variant):
    model = nn.Sequential([nn.Dense(4), nn.BatchNorm(use_running_average=True)])
    variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
    policy = get_policy("p=f32,c=f16,o=f32")
    half = variant(policy.cast_to_compute)(variables)
    dtypes = {p: v.dtype for p, v in leaves_by_path(half).items()}
    assert set(dtypes.values()) == {F16}
    assert any("batch_stats" in p for p in dtypes)
    full = variant(cast_to_full)(half)
    assert jax.tree_util.tree_structure(full) == jax.tree_util.tree_structure(variables)
    assert all(v.dtype == F32 for v in jax.tree_util.tree_leaves(full))


class Counter(nnx.Variable):
    pass


class TinyNNX(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.calls = Counter(jnp.array(0, jnp.int32))

    def __call__(self, x):
        return self.norm(self.linear(x))


def test_nnx_state(variant):
    model = TinyNNX(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    half = variant(cast_to_half)(state)
    assert isinstance(half, nnx.State)
    leaves = leaves_by_path(half)
    assert {v.dtype for p, v in leaves.items() if "calls" not in p} == {F16}
    assert [v.dtype for p, v in leaves.items() if "calls" in p] == [jnp.int32]
    half_model = nnx.merge(graphdef, half)
    assert half_model.linear.kernel[...].dtype == F16


def test_float64_is_cast_like_any_floating_leaf():
    with jax.enable_x64(True):
        x = jnp.ones(2, jnp.float64)
        assert cast_floating(x, jnp.float32).dtype == F32
        assert get_policy("f64").cast_to_compute(jnp.ones(2, jnp.float32)).dtype == jnp.float64


@pytest.mark.parametrize("bad", [jnp.int8, "int32", "complex64"])
def test_cast_to_a_non_floating_dtype_is_an_error(bad):
    with pytest.raises(ValueError, match="floating"):
        cast_floating(jnp.ones(2), bad)
