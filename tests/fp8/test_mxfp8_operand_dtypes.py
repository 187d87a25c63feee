"""mxfp8 on operands of two dtypes (a bfloat16 activation, a float32 weight, as autocast passes
a weight it has not cast): each gradient comes back in its operand's dtype on every platform
branch, so the program lowers."""

import jax
import jax.numpy as jnp

import jamp


def test_mixed_operand_dtypes_lower_and_keep_their_gradient_dtypes():
    dense = (((2,), (0,)), ((), ()))
    x, kernel = jnp.ones((2, 16, 32), jnp.bfloat16), jnp.ones((32, 32), jnp.float32)

    def loss(kernel, x):
        out = jamp.fp8.dot_general(x, kernel, dense, jamp.fp8.recipe("mxfp8"),
                                   preferred_element_type=jnp.bfloat16)
        return jnp.sum(out.astype(jnp.float32))

    d_kernel, d_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(kernel, x)
    assert (d_kernel.dtype, d_x.dtype) == (jnp.float32, jnp.bfloat16)
    assert float(d_kernel[0, 0]) == 32.0  # ones: each weight meets 2 x 16 tokens
