"""Regions inside a transformed function: `with jamp.autocast(enabled=False)`, a nested dtype,
nesting, decorators, and regions carried into nested jit/scan and through differentiation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jamp

from helpers import BF16, F16, F32, W, X, lowered_op_types


def cpu(f, **kw):
    return jamp.autocast(f, device_type="cpu", cast_outputs=False, **kw)


def three_regions(x, w):
    a = x @ w                                   # bfloat16 (the transform's dtype)
    with jamp.autocast(enabled=False):
        b = a @ w                               # float32: `a` is cast back for the user
        with jamp.autocast(dtype=jnp.float16):
            c = b @ w                           # float16: regions nest
        d = c @ w                               # float32 again
    e = d @ w                                   # bfloat16 again
    return a, b, c, d, e


def test_regions_set_each_ops_dtype(variant):
    outs = variant(cpu(three_regions))(X, W)
    assert [o.dtype for o in outs] == [BF16, F32, F16, F32, BF16]
    assert lowered_op_types(cpu(three_regions), X, W, op="dot_general") == [
        ("bfloat16",) * 3, ("float32",) * 3, ("float16",) * 3, ("float32",) * 3,
        ("bfloat16",) * 3]
    chex.assert_trees_all_close(outs, three_regions(X, W), rtol=3e-2, atol=3e-2)


def test_regions_survive_differentiation():
    loss = lambda x, w: sum(jnp.sum(o) for o in three_regions(x, w))
    g = jax.grad(jamp.autocast(loss, device_type="cpu"), argnums=1)
    dots = lowered_op_types(g, X, W, op="dot_general")
    # Each region's backward matmuls run in its forward's dtype.
    assert sorted(set(t[0] for t in dots)) == ["bfloat16", "float16", "float32"]
    assert g(X, W).dtype == F32
    want = jax.grad(loss, argnums=1)(X, W)
    np.testing.assert_allclose(g(X, W), want, rtol=3e-2, atol=3e-2)


def test_grad_taken_inside_a_region():
    def f(x, w):
        with jamp.autocast(enabled=False):
            return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)

    # Under jax.grad the region's names become jvp(...) and transpose(jvp(...)).
    assert set(lowered_op_types(cpu(f), X, W, op="dot_general")) == {("float32",) * 3}


def test_region_is_carried_into_nested_jit_and_scan(variant):
    @jax.jit
    def layer(x, w):
        return x @ w

    def f(x, w):
        with jamp.autocast(enabled=False):
            a = layer(x, w)
            b, _ = lax.scan(lambda c, _: (c @ w, None), x, None, length=2)
        return a, b, layer(x, w)

    outs = variant(cpu(f))(X, W)
    assert [o.dtype for o in outs] == [F32, F32, BF16]


def test_region_inside_a_jitted_function(variant):
    @jax.jit
    def inner(x, w):
        with jamp.autocast(dtype=jnp.float16):
            return x @ w

    assert variant(cpu(lambda x, w: (inner(x, w), x @ w)))(X, W)[0].dtype == F16


def test_decorator_marks_a_region_inside_a_transform(variant):
    @jamp.autocast(enabled=False)
    def full_precision(x, w):
        return x @ w

    @jamp.autocast(dtype=jnp.float16, cast_outputs=False)
    def half(x, w):
        return x @ w

    outs = variant(cpu(lambda x, w: (full_precision(x @ w, w), half(x, w), x @ w)))(X, W)
    assert [o.dtype for o in outs] == [F32, F16, BF16]


def test_region_outside_a_transform_changes_nothing():
    with jamp.autocast(dtype=jnp.float16):
        out = X @ W
    assert out.dtype == F32
    with jamp.autocast(enabled=False) as region:
        assert region.enabled is False


def test_region_refuses_an_op_table():
    table = jamp.policy.autocast_table("cpu")
    with pytest.raises(ValueError, match="op_table applies to a transform"):
        with jamp.autocast(op_table=table):
            pass


def test_user_low_precision_inside_disabled_region_is_kept():
    # Disabled regions run ops in the dtypes the program was written in, so a value the user
    # made bfloat16 stays bfloat16 (torch: inputs' types).
    def f(x, w):
        with jamp.autocast(enabled=False):
            return x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)

    assert cpu(f)(X, W).dtype == BF16


def test_region_scope_name_is_visible_in_the_program():
    def f(x, w):
        with jamp.autocast(enabled=False):
            return x @ w

    jaxpr = jax.make_jaxpr(f)(X, W)
    assert "jamp_autocast[enabled=0]" in str(jaxpr.jaxpr.eqns[0].source_info.name_stack)


def test_a_mixed_dtype_matmul_written_in_a_disabled_region_keeps_its_promoted_result(variant):
    # jnp.matmul of a bfloat16 and a float32 array computes in float32 (JAX's promotion, which
    # lax.dot_general spells with a float32 result and the operands as they are).
    def f(x, w):
        with jamp.autocast(enabled=False):
            return x.astype(jnp.bfloat16) @ w

    out = variant(cpu(f))(X, W)
    assert out.dtype == F32
    np.testing.assert_allclose(out, f(X, W), rtol=1e-6)
