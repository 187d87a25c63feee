"""jamp.fp8's casts, recipes and dot_general on their own: saturation under jit, the errors a
user meets, the shapes dot_general serves (batch dimensions, several contracting dimensions,
vmap) and the dtypes it returns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp.fp8.casts import quantize_dequantize
from jamp.fp8.recipes import Cast

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def test_saturating_cast_clamps_under_jit_and_keeps_nan():
    x = jnp.array([500.0, -1e9, jnp.inf, 3.0, jnp.nan])
    cast = jax.jit(jamp.fp8.saturating_cast, static_argnums=1)
    np.testing.assert_array_equal(cast(x, E4M3).astype(jnp.float32),
                                  [448.0, -448.0, 448.0, 3.0, np.nan])
    np.testing.assert_array_equal(cast(x, E5M2).astype(jnp.float32),
                                  [512.0, -57344.0, 57344.0, 3.0, np.nan])


def test_recipe_is_static_and_hashable():
    assert jamp.fp8.recipe("rowwise") == jamp.fp8.recipe("rowwise")
    assert hash(jamp.fp8.recipe("delayed")) == hash(jamp.fp8.recipe("delayed", margin=0))
    assert jamp.fp8.recipe("delayed") != jamp.fp8.recipe("delayed", amax_history_length=16)
    assert jamp.fp8.recipe("delayed").option("amax_history_length") == 1024


@pytest.mark.parametrize("call, error, words", [
    (lambda: jamp.fp8.recipe("tensorwize"), ValueError,
     ["'tensorwize'", "'tensorwise'", "'rowwise'", "'rowwise_with_gw_hp'", "'delayed'",
      "'mxfp8'"]),
    (lambda: jamp.fp8.recipe("rowwise", amax_history_length=4), TypeError,
     ["amax_history_length", "round_scales_to_power_of_2"]),
    (lambda: jamp.fp8.recipe("mxfp8", block_size=16), TypeError, ["block_size", "none"]),
    (lambda: jamp.fp8.recipe("delayed", amax_compute_algo="mean"), ValueError,
     ["'mean'", "'max'", "'most_recent'"]),
    (lambda: jamp.fp8.recipe("delayed", amax_history_length=0), ValueError,
     ["amax_history_length=0"]),
    (lambda: jamp.fp8.check_recipe(jnp.float8_e4m3fn), TypeError,
     ["float8_e4m3fn", 'jamp.fp8.recipe("tensorwise")']),
    (lambda: jamp.fp8.check_recipe("rowwise"), TypeError, ["jamp.fp8.recipe('rowwise')"]),
    (lambda: jamp.fp8.check_recipe(jnp.bfloat16), TypeError, ["not an fp8 recipe"]),
])
def test_errors_name_the_value_and_the_fix(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value)


def test_state_errors():
    x, w = jnp.ones((2, 32)), jnp.ones((32, 16))
    dims = (((1,), (0,)), ((), ()))
    delayed = jamp.fp8.recipe("delayed", amax_history_length=4)
    with pytest.raises(TypeError, match="init_delayed_state"):
        jamp.fp8.dot_general(x, w, dims, delayed)
    with pytest.raises(ValueError, match="shapes"):
        jamp.fp8.dot_general(x, w, dims, delayed,
                             state=jamp.fp8.init_delayed_state(jamp.fp8.recipe("delayed")))
    with pytest.raises(TypeError, match="keeps no state"):
        jamp.fp8.dot_general(x, w, dims, jamp.fp8.recipe("tensorwise"),
                             state=jamp.fp8.init_delayed_state(delayed))
    with pytest.raises(TypeError, match="floating"):
        jamp.fp8.dot_general(jnp.ones((2, 32), jnp.int32), w, dims, jamp.fp8.recipe("rowwise"))


def _relative_error(actual, expected):
    return float(jnp.linalg.norm(actual - expected) / jnp.linalg.norm(expected))


def test_batch_dimensions_keep_their_own_row_scales():
    # An Einsum 'bij,bjk->bik' whose two batch elements differ by 1e6 in magnitude: row scales
    # (never reduced over the batch) keep both at float8 precision; one scale per tensor
    # flushes the small one to zero.
    lhs = jax.random.normal(jax.random.key(0), (2, 4, 32)) * jnp.array([1e-3, 1e3])[:, None, None]
    rhs = jax.random.normal(jax.random.key(1), (2, 32, 8))
    dims = (((2,), (1,)), ((0,), (0,)))
    exact = jnp.einsum("bij,bjk->bik", lhs, rhs)

    def product(name):
        return jax.jit(lambda a, b: jamp.fp8.dot_general(a, b, dims, jamp.fp8.recipe(name)))(
            lhs, rhs)

    assert _relative_error(product("rowwise")[0], exact[0]) < 0.05
    assert _relative_error(product("tensorwise")[0], exact[0]) > 0.5


def test_dense_general_in_bfloat16_under_grad_and_vmap():
    # DenseGeneral: x (batch, tokens, heads, head_dim) . kernel (heads, head_dim, features).
    dims = (((2, 3), (0, 1)), ((), ()))
    one_dims = (((1, 2), (0, 1)), ((), ()))
    x = jax.random.normal(jax.random.key(2), (2, 5, 4, 16)).astype(jnp.bfloat16)
    kernel = (jax.random.normal(jax.random.key(3), (4, 16, 8)) / 8).astype(jnp.bfloat16)
    recipe = jamp.fp8.recipe("rowwise")

    def loss(x, kernel):
        return jnp.sum(jamp.fp8.dot_general(x, kernel, dims, recipe).astype(jnp.float32) ** 2)

    def reference(x, kernel):
        out = jax.lax.dot_general(x, kernel, dims, preferred_element_type=jnp.float32)
        return jnp.sum(out ** 2)

    @jax.jit
    def run(x, kernel):
        # vmap over the batch: each element scaled on its own, as one call per element.
        mapped = jax.vmap(lambda a: jamp.fp8.dot_general(a, kernel, one_dims, recipe))(x)
        one_by_one = [jamp.fp8.dot_general(a, kernel, one_dims, recipe) for a in x]
        return (jamp.fp8.dot_general(x, kernel, dims, recipe),
                jamp.fp8.dot_general(x, kernel, dims, recipe, preferred_element_type=jnp.float32),
                jax.grad(loss, argnums=(0, 1))(x, kernel), mapped, jnp.stack(one_by_one))

    out, wide, grads, mapped, one_by_one = run(x, kernel)
    assert out.dtype == jnp.bfloat16 and out.shape == (2, 5, 8)
    assert wide.dtype == jnp.float32
    expected = jax.grad(reference, argnums=(0, 1))(x.astype(jnp.float32),
                                                    kernel.astype(jnp.float32))
    for g, e, primal in zip(grads, expected, (x, kernel)):
        assert g.dtype == jnp.bfloat16 and g.shape == primal.shape
        assert _relative_error(g.astype(jnp.float32), e) < 0.1
    np.testing.assert_array_equal(mapped.astype(jnp.float32), one_by_one.astype(jnp.float32))


def test_the_lowered_program_casts_to_float8():
    # Read from the lowered program: tensorwise casts the forward operands to e4m3 and the
    # output gradient to e5m2; rowwise_with_gw_hp casts nothing to e5m2.
    x, w = jnp.ones((4, 32)), jnp.ones((32, 16))
    dims = (((1,), (0,)), ((), ()))

    def lowered(name):
        loss = lambda x, w: jnp.sum(jamp.fp8.dot_general(x, w, dims, jamp.fp8.recipe(name)))
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()

    tensorwise = lowered("tensorwise")
    assert "f8E4M3FN" in tensorwise and "f8E5M2" in tensorwise
    assert "f8E5M2" not in lowered("rowwise_with_gw_hp")


def test_mxfp8_blocks_scale_by_powers_of_two_without_saturating():
    # 40 elements along the contracting dimension: a block of 32 large values (amax above
    # e4m3's 448) and a padded block of 8 tiny ones; each keeps float8 precision.
    x = jnp.concatenate([jnp.linspace(-700.0, 700.0, 32), jnp.linspace(1e-4, 8e-4, 8)])[None]
    restored = jax.jit(quantize_dequantize, static_argnums=(1, 2))(x, Cast(E4M3, "block"), (1,))
    np.testing.assert_allclose(restored, x, rtol=2 ** -4)
    assert float(restored[0, 31]) == 704.0  # 700 at scale 2: 350 -> 352 in e4m3, not 448


def _equation(fn, *args):
    (eqn,) = jax.make_jaxpr(fn)(*args).eqns
    return eqn.params


def test_convolution_takes_the_equations_params():
    # flax's Conv layout (NHWC, HWIO) with "SAME" padding: the equation's params, passed as
    # they are, give the product the explicit call gives, close to the float32 convolution,
    # with gradients in the operands' dtypes.
    x = jax.random.normal(jax.random.key(4), (2, 8, 8, 16))
    kernel = jax.random.normal(jax.random.key(5), (3, 3, 16, 8)) / 12
    numbers = ("NHWC", "HWIO", "NHWC")
    conv = lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",  # noqa: E731
                                                     dimension_numbers=numbers)
    params = _equation(conv, x, kernel)
    recipe = jamp.fp8.recipe("rowwise")

    @jax.jit
    def run(x, kernel):
        def loss(x, kernel):
            out = jamp.fp8.conv_general_dilated(x, kernel, **params, recipe=recipe)
            return jnp.sum(out ** 2), out

        explicit = jamp.fp8.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                                 dimension_numbers=numbers, recipe=recipe)
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, kernel)
        return out, explicit, grads

    out, explicit, grads = run(x, kernel)
    np.testing.assert_array_equal(out, explicit)
    assert _relative_error(out, conv(x, kernel)) < 0.05
    expected = jax.grad(lambda x, k: jnp.sum(conv(x, k) ** 2), argnums=(0, 1))(x, kernel)
    for g, e in zip(grads, expected):
        assert g.dtype == jnp.float32 and _relative_error(g, e) < 0.1


def test_dot_general_takes_the_equations_params():
    x, w = jnp.ones((4, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
    params = _equation(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32), x, w)
    out = jax.jit(lambda x, w: jamp.fp8.dot_general(x, w, recipe=jamp.fp8.recipe("tensorwise"),
                                                    **params))(x, w)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, jnp.full((4, 16), 32.0))


@pytest.mark.parametrize("tokens, native", [(64, True), (48, False)])
def test_mxfp8_lowers_to_the_block_scaled_gemm_for_cuda(tokens, native):
    # Exported for CUDA (no GPU needed), the mxfp8 product is cuDNN's block-scaled GEMM where
    # its rules accept the shapes (multiples of 32 along each GEMM's contracting dimensions),
    # the emulation where not; on this machine's CPU, the emulation runs either way.
    x, w = jnp.ones((tokens, 64)), jnp.ones((64, 32))
    dims = (((1,), (0,)), ((), ()))
    loss = jax.jit(jax.grad(lambda x, w: jnp.sum(jamp.fp8.dot_general(
        x, w, dims, jamp.fp8.recipe("mxfp8"))), argnums=(0, 1)))
    # cuDNN's call has no serialization guarantee: the export is read, never saved.
    unsaved = [jax.export.DisabledSafetyCheck.custom_call("__op$block_scaled_dot")]
    text = jax.export.export(loss, platforms=("cuda",), disabled_checks=unsaved)(x, w).mlir_module()
    assert ("block_scaled_dot" in text) == native
    if native:
        np.testing.assert_array_equal(loss(x, w)[0], jnp.full((tokens, 64), 32.0))
