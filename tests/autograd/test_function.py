"""jamp.autograd.Function: torch.autograd.Function's surface on jax.custom_vjp / custom_jvp.

Each feature runs eagerly and under jit (`variant`), under grad, vmap and grad of grad, with
values held against torch.autograd.Function running the same math in float64.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp.autograd.function import Function, FunctionCtx, once_differentiable

from helpers import X, W, eqn_dtypes, jaxpr_eqns, lowered_op_types

A = jnp.array([0.5, -1.0, 2.0])
B = jnp.array([1.5, 0.25, -0.75])


def as_torch(torch, x, requires_grad=True):
    return torch.tensor(np.asarray(x, np.float64), requires_grad=requires_grad)


# -- seed 001's example --------------------------------------------------------------------


class Exp(Function):
    @staticmethod
    def forward(ctx, i):
        result = jnp.exp(i)
        ctx.save_for_backward(result)
        return result

    @staticmethod
    def backward(ctx, grad_output):
        result, = ctx.saved_tensors
        return grad_output * result


def test_exp_example_values_and_grads(variant):
    np.testing.assert_allclose(variant(Exp.apply)(A), jnp.exp(A), rtol=1e-6)
    grad = variant(jax.grad(lambda x: Exp.apply(x).sum()))
    np.testing.assert_allclose(grad(A), jnp.exp(A), rtol=1e-6)


def test_exp_example_under_vmap_and_grad_of_grad(variant):
    batch = jnp.stack([A, B])
    np.testing.assert_allclose(variant(jax.vmap(Exp.apply))(batch), jnp.exp(batch), rtol=1e-6)
    grad = jax.grad(lambda x: Exp.apply(x).sum())
    np.testing.assert_allclose(variant(jax.vmap(grad))(batch), jnp.exp(batch), rtol=1e-6)
    # backward is differentiable jnp code, so its own derivative is exp again.
    second = variant(jax.grad(lambda x: grad(x).sum()))
    np.testing.assert_allclose(second(A), jnp.exp(A), rtol=1e-6)
    np.testing.assert_allclose(jax.hessian(lambda x: Exp.apply(x).sum())(A),
                               jnp.diag(jnp.exp(A)), rtol=1e-6)


def test_exp_matches_torch_in_float64(torch, x64):
    class TorchExp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, i):
            result = i.exp()
            ctx.save_for_backward(result)
            return result

        @staticmethod
        def backward(ctx, grad_output):
            result, = ctx.saved_tensors
            return grad_output * result

    a = A.astype(jnp.float64)
    t = as_torch(torch, a)
    out = TorchExp.apply(t)
    (g,) = torch.autograd.grad((out * out).sum(), t, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), t)
    grad = jax.grad(lambda x: (Exp.apply(x) ** 2).sum())
    assert grad(a).dtype == jnp.float64
    np.testing.assert_allclose(Exp.apply(a), out.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(grad(a), g.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(jax.grad(lambda x: grad(x).sum())(a), gg.numpy(), rtol=1e-12)


# -- several inputs, static arguments, two outputs: against torch ---------------------------


class Affine(Function):
    """tanh(x @ w) * scale and the row sums of x; `scale` is a Python number."""

    @staticmethod
    def forward(ctx, x, w, scale):
        y = jnp.tanh(x @ w)
        ctx.save_for_backward(x, w, y)
        ctx.scale = scale
        return y * scale, x.sum(axis=1)

    @staticmethod
    def backward(ctx, g_out, g_sum):
        x, w, y = ctx.saved_tensors
        g_pre = g_out * ctx.scale * (1 - y * y)
        gx = g_pre @ w.T + g_sum[:, None]
        return gx, x.T @ g_pre, None


def affine_loss(apply):
    def loss(x, w):
        out, rows = apply(x, w, 1.5)
        return (out ** 2).sum() + (rows ** 3).sum()
    return loss


def test_two_outputs_and_a_static_argument_match_torch(torch, x64, variant):
    class TorchAffine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, scale):
            y = torch.tanh(x @ w)
            ctx.save_for_backward(x, w, y)
            ctx.scale = scale
            return y * scale, x.sum(dim=1)

        @staticmethod
        def backward(ctx, g_out, g_sum):
            x, w, y = ctx.saved_tensors
            g_pre = g_out * ctx.scale * (1 - y * y)
            return g_pre @ w.T + g_sum[:, None], x.T @ g_pre, None

    x, w = X.astype(jnp.float64), W.astype(jnp.float64)
    tx, tw = as_torch(torch, x), as_torch(torch, w)
    want = torch.autograd.grad(affine_loss(TorchAffine.apply)(tx, tw), (tx, tw))
    got = variant(jax.grad(affine_loss(Affine.apply), argnums=(0, 1)))(x, w)
    for g, t in zip(got, want, strict=True):
        assert g.dtype == jnp.float64
        np.testing.assert_allclose(g, t.numpy(), rtol=1e-12)


def test_needs_input_grad_is_true_exactly_for_the_differentiated_inputs(variant):
    seen = []

    class Mul(Function):
        @staticmethod
        def forward(ctx, x, y, k):
            seen.append(("forward", ctx.needs_input_grad))
            ctx.save_for_backward(x, y)
            ctx.k = k
            return x * y * k

        @staticmethod
        def backward(ctx, g):
            seen.append(("backward", ctx.needs_input_grad))
            x, y = ctx.saved_tensors
            gx = g * y * ctx.k if ctx.needs_input_grad[0] else None
            gy = g * x * ctx.k if ctx.needs_input_grad[1] else None
            return gx, gy, None

    loss = lambda x, y: Mul.apply(x, y, 2.0).sum()
    variant(loss)(A, B)
    assert seen == [("forward", (False, False, False))]
    want = (2 * B, 2 * A)
    for argnums in [(0,), (1,), (0, 1)]:
        seen.clear()
        grads = variant(jax.grad(loss, argnums=argnums))(A, B)
        needs = (0 in argnums, 1 in argnums, False)
        assert seen == [("forward", needs), ("backward", needs)]
        for g, i in zip(grads, argnums, strict=True):
            np.testing.assert_allclose(g, want[i])


def test_one_jitted_program_differentiated_with_respect_to_each_input():
    seen = []

    class Mul(Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(*(v for v, n in zip((y, x), ctx.needs_input_grad) if n))
            return x * y

        @staticmethod
        def backward(ctx, g):
            seen.append(ctx.needs_input_grad)
            saved = iter(ctx.saved_tensors)
            return tuple(g * next(saved) if n else None for n in ctx.needs_input_grad)

    loss = jax.jit(lambda x, y: Mul.apply(x, y).sum())
    np.testing.assert_allclose(jax.grad(loss, argnums=0)(A, B), B)
    np.testing.assert_allclose(jax.grad(loss, argnums=1)(A, B), A)
    assert seen == [(True, False), (False, True)]


def test_non_array_arguments_are_static_with_no_gradient(variant):
    class Scale(Function):
        @staticmethod
        def forward(ctx, x, factor, mode, fn, unused):
            assert isinstance(factor, float) and mode == "double" and unused is None
            ctx.factor = factor * (2 if mode == "double" else 1)
            ctx.fn = fn
            return fn(x) * ctx.factor

        @staticmethod
        def backward(ctx, g):
            return g * ctx.factor, None, None, None, None

    f = variant(jax.grad(lambda x: Scale.apply(x, 1.5, "double", jnp.negative, None).sum()))
    np.testing.assert_allclose(f(A), jnp.full(3, 3.0))


def test_keyword_arguments_bind_to_forwards_parameters(variant):
    class Shift(Function):
        @staticmethod
        def forward(ctx, x, shift=1.0, power=2):
            ctx.save_for_backward(x)
            ctx.power = power
            return (x + shift) ** power

        @staticmethod
        def backward(ctx, g):
            x, = ctx.saved_tensors
            return g * ctx.power * (x + 1.0) ** (ctx.power - 1), None, None

    f = variant(jax.grad(lambda x: Shift.apply(x, power=3).sum()))
    np.testing.assert_allclose(f(A), 3 * (A + 1) ** 2, rtol=1e-6)


def test_none_saved_and_non_array_outputs(variant):
    class Tagged(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(None, x)
            return 2 * x, "doubled"

        @staticmethod
        def backward(ctx, g, g_tag):
            nothing, x = ctx.saved_tensors
            assert nothing is None and g_tag is None
            return 2 * g

    out, tag = Tagged.apply(A)
    assert tag == "doubled"
    np.testing.assert_allclose(out, 2 * A)
    np.testing.assert_allclose(variant(jax.grad(lambda x: Tagged.apply(x)[0].sum()))(A), 2.0)


def test_numpy_inputs_are_arrays():
    grad = jax.grad(lambda x: Exp.apply(x).sum())
    np.testing.assert_allclose(Exp.apply(np.asarray(A)), jnp.exp(A), rtol=1e-6)
    np.testing.assert_allclose(grad(np.asarray(A)), jnp.exp(A), rtol=1e-6)


# -- ctx -------------------------------------------------------------------------------------


def test_ctx_attributes_hold_arrays_and_python_values(variant):
    class Poly(Function):
        @staticmethod
        def forward(ctx, x, coefficients):
            ctx.powers = (x, x * x)  # arrays in a container travel as residuals
            ctx.meta = {"degree": len(coefficients), "shape": x.shape}
            ctx.coefficients = coefficients
            return sum(c * x ** k for k, c in enumerate(coefficients))

        @staticmethod
        def backward(ctx, g):
            assert ctx.meta["shape"] == (3,) and isinstance(ctx.meta["degree"], int)
            x, x2 = ctx.powers
            c = ctx.coefficients
            return g * (c[1] + 2 * c[2] * x + 3 * c[3] * x2), None

    coefficients = (1.0, 2.0, -1.0, 0.5)
    f = variant(jax.grad(lambda x: Poly.apply(x, coefficients).sum()))
    np.testing.assert_allclose(f(A), 2.0 - 2.0 * A + 1.5 * A ** 2, rtol=1e-6)


def test_setup_context_form_matches_the_ctx_form(variant):
    class ExpSetup(Function):
        @staticmethod
        def forward(x, scale):
            return jnp.exp(x) * scale

        @staticmethod
        def setup_context(ctx, inputs, output):
            x, scale = inputs
            ctx.save_for_backward(output)
            ctx.scale = scale

        @staticmethod
        def backward(ctx, g):
            out, = ctx.saved_tensors
            return g * out, None

    f = variant(jax.grad(lambda x: ExpSetup.apply(x, scale=3.0).sum()))
    np.testing.assert_allclose(f(A), 3.0 * jnp.exp(A), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(ExpSetup.apply, (0, None))(jnp.stack([A, B]), 2.0),
                               2.0 * jnp.exp(jnp.stack([A, B])), rtol=1e-6)


class SortWithIndices(Function):
    """Sorted values and the argsort indices (integers, marked non-differentiable)."""

    received = []

    @staticmethod
    def forward(ctx, x):
        order = jnp.argsort(x)
        ctx.mark_non_differentiable(order)
        ctx.save_for_backward(order)
        return x[order], order

    @staticmethod
    def backward(ctx, g_values, g_order):
        SortWithIndices.received.append(g_order)
        order, = ctx.saved_tensors
        return jnp.zeros_like(g_values).at[order].set(g_values)


def test_non_differentiable_outputs_get_zero_gradients(variant):
    SortWithIndices.received.clear()
    weights = jnp.array([1.0, 2.0, 3.0])
    loss = lambda x: (SortWithIndices.apply(x)[0] * weights).sum()
    np.testing.assert_allclose(variant(jax.grad(loss))(A), jnp.array([2.0, 1.0, 3.0]))
    g_order, = SortWithIndices.received
    chex.assert_shape(g_order, (3,))  # torch: zeros like the output
    chex.assert_type(g_order, jnp.int32)


def test_marked_float_output_passes_no_gradient(variant):
    class Split(Function):
        @staticmethod
        def forward(ctx, x):
            doubled = 2 * x
            ctx.mark_non_differentiable(doubled)
            return 3 * x, doubled

        @staticmethod
        def backward(ctx, g, g_doubled):
            return 3 * g + 2 * g_doubled  # g_doubled is zeros whatever the caller did

    loss = lambda x: sum(o.sum() for o in Split.apply(x))
    np.testing.assert_allclose(variant(jax.grad(loss))(A), jnp.full(3, 3.0))


@pytest.mark.parametrize("materialize", [True, False])
def test_set_materialize_grads(materialize, variant):
    received = []

    class TwoOut(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(materialize)
            return 2 * x, 3 * x

        @staticmethod
        def backward(ctx, g1, g2):
            received.append((g1 is None, g2 is None))
            return (0 if g1 is None else 2 * g1) + (0 if g2 is None else 3 * g2)

    grad = variant(jax.grad(lambda x: TwoOut.apply(x)[0].sum()))
    np.testing.assert_allclose(grad(A), jnp.full(3, 2.0))
    assert received == [(False, not materialize)]
    received.clear()
    both = variant(jax.grad(lambda x: sum(o.sum() for o in TwoOut.apply(x))))
    np.testing.assert_allclose(both(A), jnp.full(3, 5.0))
    assert received == [(False, False)]


def test_mark_dirty_is_accepted_and_changes_nothing(variant):
    class AddOne(Function):
        @staticmethod
        def forward(ctx, x):
            x = x + 1  # torch: x.add_(1)
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    np.testing.assert_allclose(variant(AddOne.apply)(A), A + 1)
    np.testing.assert_allclose(variant(jax.grad(lambda x: AddOne.apply(x).sum()))(A), 1.0)


def test_ctx_is_a_function_ctx():
    kinds = []

    class Probe(Function):
        @staticmethod
        def forward(ctx, x):
            kinds.append(type(ctx))
            return x

        @staticmethod
        def backward(ctx, g):
            kinds.append(type(ctx))
            return g

    jax.grad(lambda x: Probe.apply(x).sum())(A)
    assert kinds == [FunctionCtx, FunctionCtx]


# -- grad of grad, once_differentiable ------------------------------------------------------


class Cube(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return 3 * x ** 2 * g


def test_grad_of_grad_through_a_differentiable_backward_matches_torch(torch, x64, variant):
    class TorchCube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x ** 3

        @staticmethod
        def backward(ctx, g):
            x, = ctx.saved_tensors
            return 3 * x ** 2 * g

    a = A.astype(jnp.float64)
    t = as_torch(torch, a)
    (g,) = torch.autograd.grad(TorchCube.apply(t).sin().sum(), t, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), t)
    grad = jax.grad(lambda x: jnp.sin(Cube.apply(x)).sum())
    np.testing.assert_allclose(variant(grad)(a), g.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(variant(jax.grad(lambda x: grad(x).sum()))(a), gg.numpy(),
                               rtol=1e-12)
    # Forward over reverse differentiates the backward too.
    np.testing.assert_allclose(jax.jacfwd(grad)(a), np.diag(gg.numpy()), rtol=1e-12)


class CubeOnce(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return 3 * x ** 2 * g


def test_once_differentiable_keeps_the_first_derivative(variant):
    grad = variant(jax.grad(lambda x: CubeOnce.apply(x).sum()))
    np.testing.assert_allclose(grad(A), 3 * A ** 2, rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(jax.grad(lambda x: CubeOnce.apply(x)))(A), 3 * A ** 2,
                               rtol=1e-6)


@pytest.mark.parametrize("second", ["grad", "jacfwd"])
def test_once_differentiable_refuses_a_second_derivative(second, variant):
    grad = jax.grad(lambda x: CubeOnce.apply(x).sum())
    outer = jax.grad(lambda x: grad(x).sum()) if second == "grad" else jax.jacfwd(grad)
    with pytest.raises(RuntimeError, match="CubeOnce is marked @once_differentiable"):
        variant(outer)(A)


def test_jax_checkpoint_around_apply(variant):
    f = jax.checkpoint(lambda x: jnp.sin(Cube.apply(x)))
    grad = variant(jax.grad(lambda x: f(x).sum()))
    np.testing.assert_allclose(grad(A), jnp.cos(A ** 3) * 3 * A ** 2, rtol=1e-5)


# -- forward mode: jvp ---------------------------------------------------------------------


class MulJvp(Function):
    """x * y with a backward and a jvp."""

    calls = []

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        ctx.save_for_forward(x, y)
        return x * y

    @staticmethod
    def backward(ctx, g):
        MulJvp.calls.append("backward")
        x, y = ctx.saved_tensors
        return g * y, g * x

    @staticmethod
    def jvp(ctx, tx, ty):
        MulJvp.calls.append(("jvp", ctx.needs_input_grad))
        x, y = ctx.saved_tensors
        return tx * y + x * ty


class MulJvpOnly(Function):
    """x * y with a jvp and no backward: reverse mode transposes the jvp."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_forward(x, y)
        return x * y

    jvp = MulJvp.jvp


def test_jvp_gives_forward_mode_and_backward_reverse_mode(variant):
    MulJvp.calls.clear()
    tangent = jnp.ones(3)
    primal, out = variant(lambda x, t: jax.jvp(lambda x: MulJvp.apply(x, B), (x,), (t,)))(A, tangent)
    np.testing.assert_allclose(primal, A * B)
    np.testing.assert_allclose(out, B)
    assert MulJvp.calls == [("jvp", (True, False))]  # the jvp saw zeros for y's tangent
    np.testing.assert_allclose(variant(jax.jacfwd(MulJvp.apply, argnums=1))(A, B), jnp.diag(A))
    MulJvp.calls.clear()
    np.testing.assert_allclose(variant(jax.grad(lambda x: MulJvp.apply(x, B).sum()))(A), B)
    assert MulJvp.calls == ["backward"]


def test_jvp_under_vmap_and_hessians(variant):
    batch = jnp.stack([A, B])
    pushforward = lambda x: jax.jvp(lambda x: MulJvp.apply(x, x), (x,), (jnp.ones(3),))[1]
    np.testing.assert_allclose(variant(jax.vmap(pushforward))(batch), 2 * batch)
    through_vmap = jax.jvp(jax.vmap(lambda x: MulJvp.apply(x, x)), (batch,), (batch,))[1]
    np.testing.assert_allclose(through_vmap, 2 * batch * batch)
    for fn in (MulJvp, MulJvpOnly):
        hessian = variant(jax.hessian(lambda x: fn.apply(x, x).sum()))
        np.testing.assert_allclose(hessian(A), 2 * jnp.eye(3))


def test_a_jvp_only_function_is_differentiated_in_both_modes(variant):
    grad = variant(jax.grad(lambda x, y: MulJvpOnly.apply(x, y).sum(), argnums=(0, 1)))
    gx, gy = grad(A, B)
    np.testing.assert_allclose(gx, B)
    np.testing.assert_allclose(gy, A)
    _, tangent = variant(lambda: jax.jvp(MulJvpOnly.apply, (A, B), (A, B)))()
    np.testing.assert_allclose(tangent, 2 * A * B)
    # through a staged region too: the jvp-only class has one path.
    np.testing.assert_allclose(jax.jvp(jax.jit(MulJvpOnly.apply), (A, B), (A, B))[1], 2 * A * B)


def test_jvp_matches_torch_forward_ad(torch, x64):
    fwAD = torch.autograd.forward_ad

    class TorchMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_forward(x, y)
            return torch.sin(x) * y

        @staticmethod
        def jvp(ctx, tx, ty):
            x, y = ctx.saved_tensors
            return torch.cos(x) * tx * y + torch.sin(x) * ty

    class SinMul(Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_forward(x, y)
            return jnp.sin(x) * y

        @staticmethod
        def jvp(ctx, tx, ty):
            x, y = ctx.saved_tensors
            return jnp.cos(x) * tx * y + jnp.sin(x) * ty

    a, b = A.astype(jnp.float64), B.astype(jnp.float64)
    ta, tb = a * 0.5 + 1, b - 2
    with fwAD.dual_level():
        out = TorchMul.apply(fwAD.make_dual(as_torch(torch, a, False), as_torch(torch, ta, False)),
                             fwAD.make_dual(as_torch(torch, b, False), as_torch(torch, tb, False)))
        want = fwAD.unpack_dual(out).tangent.numpy()
    np.testing.assert_allclose(jax.jvp(SinMul.apply, (a, b), (ta, tb))[1], want, rtol=1e-12)


def test_forward_mode_through_a_staged_region_needs_the_jvp_only_form():
    # Documented: under jax.jit apply cannot see the jvp outside, takes the custom_vjp path,
    # and JAX refuses forward mode of a custom_vjp.
    with pytest.raises(TypeError, match="forward-mode autodiff"):
        jax.jvp(jax.jit(lambda x: MulJvp.apply(x, B)), (A,), (A,))


# -- errors ----------------------------------------------------------------------------------


def test_wrong_number_of_gradients_is_an_error_naming_the_function():
    class Bad(Function):
        @staticmethod
        def forward(ctx, x, y):
            return x * y

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(RuntimeError, match=r"backward of Bad returned 1 gradient for 2 inputs"):
        jax.grad(lambda x: Bad.apply(x, B).sum())(A)


def test_trailing_extra_nones_are_dropped_as_in_torch():
    class Extra(Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, g):
            return 2 * g, None, None

    np.testing.assert_allclose(jax.grad(lambda x: Extra.apply(x).sum())(A), 2.0)


def test_wrong_gradient_shape_is_an_error_naming_the_input(variant):
    class Bad(Function):
        @staticmethod
        def forward(ctx, x, y):
            return x[:2] * y

        @staticmethod
        def backward(ctx, g):
            return jnp.ones(3), jnp.ones(3)

    with pytest.raises(RuntimeError, match=r"gradient for input 1 \(y\) has shape \(3,\), "
                                           r"expected \(2,\)"):
        variant(jax.grad(lambda y: Bad.apply(A, y).sum()))(B[:2])


def test_a_gradient_its_input_broadcasts_to_is_summed_as_in_torch(variant):
    class Scale(Function):
        @staticmethod
        def forward(ctx, x, s):
            ctx.save_for_backward(x, s)
            return x * s

        @staticmethod
        def backward(ctx, g):
            x, s = ctx.saved_tensors
            return g * s, g * x  # the second has x's shape, s is a scalar

    grad = variant(jax.grad(lambda s: Scale.apply(A, s).sum()))
    np.testing.assert_allclose(grad(jnp.float32(2.0)), A.sum(), rtol=1e-6)


def test_gradients_are_cast_to_the_input_dtype(variant):
    class Half(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return (2 * g).astype(jnp.float16)

    assert variant(jax.grad(lambda x: Half.apply(x).sum()))(A).dtype == jnp.float32


def test_gradient_for_a_non_array_input_is_an_error():
    class Bad(Function):
        @staticmethod
        def forward(ctx, x, k):
            return x * k

        @staticmethod
        def backward(ctx, g):
            return g, g

    with pytest.raises(RuntimeError, match=r"gradient for input 1 \(k\), which is a float"):
        jax.grad(lambda x: Bad.apply(x, 2.0).sum())(A)


def test_arrays_inside_containers_get_no_gradient():
    class Sum(Function):
        @staticmethod
        def forward(ctx, x, others):
            return x + sum(others)

        @staticmethod
        def backward(ctx, g):
            return g, None

    np.testing.assert_allclose(jax.grad(lambda x: Sum.apply(x, [A, B]).sum())(A), 1.0)
    np.testing.assert_allclose(jax.jit(Sum.apply)(A, [A, B]), 2 * A + B)
    with pytest.raises(TypeError, match=r"argument 1 \(others\) is a list holding an array"):
        jax.grad(lambda b: Sum.apply(A, [A, b]).sum())(B)


def test_bad_ctx_use_is_an_error():
    class SavesFloat(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x, 2.0)
            return x

    with pytest.raises(TypeError, match="argument 1 is a float: store other values as ctx"):
        SavesFloat.apply(A)

    class Materialize(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads("no")
            return x

    with pytest.raises(TypeError, match="value must be True or False"):
        Materialize.apply(A)


def test_forward_returning_a_list_of_arrays_is_an_error():
    class Listed(Function):
        @staticmethod
        def forward(ctx, x):
            return [x, x]

    with pytest.raises(TypeError, match="returned output 0 as a list holding arrays"):
        Listed.apply(A)


def test_missing_methods_are_errors():
    class NoBackward(Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

    np.testing.assert_allclose(NoBackward.apply(A), 2 * A)
    with pytest.raises(NotImplementedError, match="NoBackward defines no backward"):
        jax.grad(lambda x: NoBackward.apply(x).sum())(A)
    # torch's type: forward mode of a Function without jvp is a NotImplementedError.
    with pytest.raises(NotImplementedError,
                       match=r"NoBackward defines no jvp: .*needs a static jvp\(ctx, \*tangents\)"):
        jax.jvp(NoBackward.apply, (A,), (A,))
    with pytest.raises(NotImplementedError, match="NoBackward defines no jvp"):
        jax.jacfwd(lambda x: NoBackward.apply(x).sum())(A)

    class Both(Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, g):
            return 2 * g

        vjp = backward

    with pytest.raises(RuntimeError, match="defines both backward and vjp"):
        Both.apply(A)


def test_vjp_is_backwards_other_name(variant):
    class Twice(Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def vjp(ctx, g):
            return 2 * g

    np.testing.assert_allclose(variant(jax.grad(lambda x: Twice.apply(x).sum()))(A), 2.0)


def test_jvp_errors():
    class WrongCount(Function):
        @staticmethod
        def forward(ctx, x):
            return x, 2 * x

        @staticmethod
        def jvp(ctx, t):
            return t

    with pytest.raises(RuntimeError, match="jvp of WrongCount returned 1 tangent for 2 outputs"):
        jax.jvp(WrongCount.apply, (A,), (A,))


# -- autocast: jamp.custom_fwd / jamp.custom_bwd on forward and backward -----------------------


def make_matmul(fwd_deco=lambda f: f, bwd_deco=lambda f: f, extra_output=False):
    class MatMul(Function):
        @staticmethod
        @fwd_deco
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            out = x @ w
            return (out, 2 * x) if extra_output else out

        @staticmethod
        @bwd_deco
        def backward(ctx, g, *g_extra):
            x, w = ctx.saved_tensors
            gx = g @ w.T + (2 * g_extra[0] if g_extra else 0)
            return gx, x.T @ g

    return MatMul


def matmul_dots(matmul, extra_output=False):
    def loss(x, w):
        out = matmul.apply(x, w)
        return jnp.sum(jnp.tanh(out[0] if extra_output else out))

    grad = jax.grad(jamp.autocast(loss, device_type="cpu"), argnums=(0, 1))
    gx, gw = grad(X, W)
    assert gx.dtype == gw.dtype == jnp.float32
    return lowered_op_types(grad, X, W, op="dot_general")


def test_autocast_runs_forward_low_and_an_undecorated_backward_in_its_inputs_types():
    fwd, *bwd = matmul_dots(make_matmul())
    assert fwd == ("bfloat16",) * 3
    assert set(bwd) == {("float32",) * 3}


def test_custom_fwd_and_custom_bwd_decorate_forward_and_backward():
    fwd, *bwd = matmul_dots(make_matmul(jamp.custom_fwd(cast_inputs=jnp.float32)))
    assert fwd == ("float32",) * 3
    fwd, *bwd = matmul_dots(make_matmul(bwd_deco=jamp.custom_bwd))
    assert [fwd, *bwd] == [("bfloat16",) * 3] * 3
    # torch: backward runs under the forward's autocast state, not custom_fwd's inner one.
    fwd, *bwd = matmul_dots(make_matmul(jamp.custom_fwd(cast_inputs=jnp.float32),
                                        jamp.custom_bwd))
    assert fwd == ("float32",) * 3
    assert bwd == [("bfloat16",) * 3] * 2


def test_custom_bwd_holds_when_an_output_is_unused():
    matmul = make_matmul(bwd_deco=jamp.custom_bwd, extra_output=True)
    assert matmul_dots(matmul, extra_output=True) == [("bfloat16",) * 3] * 3


def test_custom_fwd_on_the_setup_context_form():
    class MatMul(Function):
        @staticmethod
        @jamp.custom_fwd(cast_inputs=jnp.float32)
        def forward(x, w):
            return x @ w

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs)

        @staticmethod
        @jamp.custom_bwd
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w.T, x.T @ g

    fwd, *bwd = matmul_dots(MatMul)
    assert fwd == ("float32",) * 3
    assert bwd == [("bfloat16",) * 3] * 2


# -- autocast: forward and backward see the dtypes torch's see -----------------------------------


def branch_on_dtype(base, low, custom_fwd=lambda f: f, custom_bwd=lambda f: f):
    """A Function (of `base`: jamp's or torch's) whose forward picks its math by its input's
    dtype and whose backward picks it by its grad's (`low`: the framework's bfloat16)."""

    class BranchOnDtype(base):
        @staticmethod
        @custom_fwd
        def forward(ctx, x):
            ctx.factor = 2.0 if x.dtype == low else 3.0
            return x * ctx.factor

        @staticmethod
        @custom_bwd
        def backward(ctx, g):
            return g * ctx.factor * (5.0 if g.dtype == low else 7.0)

    return BranchOnDtype


@pytest.mark.parametrize("cast_to_float32", [False, True])
def test_under_autocast_forward_and_backward_see_torchs_dtypes(torch, cast_to_float32):
    # torch: a Function called on a lowered matmul's result gets it in bfloat16 (forward's
    # x.dtype, its output, backward's grad); with custom_fwd(cast_inputs=float32), in float32.
    def decorated(framework, low):
        base = Function if framework is jamp else torch.autograd.Function
        if not cast_to_float32:
            return branch_on_dtype(base, low)
        fwd = (jamp.custom_fwd(cast_inputs=jnp.float32) if framework is jamp else
               torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32))
        bwd = jamp.custom_bwd if framework is jamp else torch.amp.custom_bwd(device_type="cpu")
        return branch_on_dtype(base, low, fwd, bwd)

    mine = decorated(jamp, jnp.bfloat16)
    loss = jamp.autocast(lambda x, w: mine.apply(x @ w).astype(jnp.float32).sum(),
                         device_type="cpu")
    value, grad = jax.value_and_grad(loss, argnums=1)(X, W)

    theirs = decorated(torch, torch.bfloat16)
    x, w = torch.tensor(np.asarray(X)), torch.tensor(np.asarray(W), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = theirs.apply(x @ w)
        expected = out.float().sum()
    expected.backward()
    np.testing.assert_allclose(value, expected.item(), rtol=2e-2)
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(grad, w.grad.numpy(), rtol=2e-2, atol=1e-2)
    # The Function's call in the transformed program takes and returns torch's dtypes.
    call, = jaxpr_eqns(jax.make_jaxpr(loss)(X, W), "custom_vjp_call")
    low = "float32" if cast_to_float32 else "bfloat16"
    assert eqn_dtypes(call) == ([low], [low]) and str(out.dtype) == f"torch.{low}"


def test_under_autocast_a_function_outside_the_lowered_ops_sees_float32():
    fn = branch_on_dtype(Function, jnp.bfloat16)
    loss = lambda x, w: fn.apply(jnp.tanh(x) @ w).sum()
    with_region = jamp.autocast(
        lambda x, w: jamp.autocast(enabled=False)(loss)(x, w), device_type="cpu")
    np.testing.assert_allclose(with_region(X, W), 3.0 * (jnp.tanh(X) @ W).sum(), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(with_region, argnums=1)(X, W),
                               21.0 * jnp.tanh(X).T @ jnp.ones((3, 4)), rtol=1e-6)
