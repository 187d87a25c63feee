"""gradcheck and gradgradcheck: they pass right derivatives and catch wrong ones (a wrong
`jax.custom_vjp` backward, a wrong `jax.custom_jvp` rule, a backward that vmap cannot batch,
one that breaks on an unused output, one that is not reentrant), with torch's keywords,
messages and warnings (torch's CPU build, the test-only oracle, for the messages)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp.autograd import GradcheckError, gradcheck, gradgradcheck
from jamp.autograd.finite_difference import PerturbedOutputError

pytestmark = pytest.mark.usefixtures("x64")

X = np.array([0.3, 0.7, 1.1])
Y = np.array([1.5, -2.0, 0.5])


def inputs():
    return jnp.asarray(X), jnp.asarray(Y)


def sin_times(scale_x=1.0, scale_y=1.0):
    """`sin(x) * y` with a hand-written backward, wrong by `scale_x` / `scale_y` when != 1."""

    @jax.custom_vjp
    def f(x, y):
        return jnp.sin(x) * y

    def bwd(res, ct):
        x, y = res
        return ct * jnp.cos(x) * y * scale_x, ct * jnp.sin(x) * scale_y

    f.defvjp(lambda x, y: (f(x, y), (x, y)), bwd)
    return f


@pytest.mark.parametrize("fast_mode", [False, True])
def test_passes_a_right_backward(fast_mode):
    assert gradcheck(sin_times(), inputs(), fast_mode=fast_mode, check_batched_grad=True)


@pytest.mark.parametrize("fast_mode", [False, True])
@pytest.mark.parametrize("wrong", [0, 1])
def test_fails_a_wrong_backward_naming_the_input(wrong, fast_mode):
    f = sin_times(**{("scale_x", "scale_y")[wrong]: 1.1})
    with pytest.raises(GradcheckError, match="Jacobian mismatch for output 0 with respect to "
                                             f"input {wrong},\nnumerical:") as info:
        gradcheck(f, inputs(), fast_mode=fast_mode)
    assert "\nanalytical:" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    if fast_mode:  # the full Jacobians are shown too
        assert "Numerical:\n[[" in str(info.value) and "Analytical:\n[[" in str(info.value)


def test_shows_the_jacobians_in_torchs_layout(torch):

    class WrongSinTimes(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x, y)
            return torch.sin(x) * y

        @staticmethod
        def backward(ctx, grad):
            x, y = ctx.saved_tensors
            return grad * torch.cos(x) * y, grad * torch.sin(x) * 1.1

    tx, ty = (torch.tensor(a, requires_grad=True) for a in (X, Y))
    with pytest.raises(RuntimeError) as want:
        torch.autograd.gradcheck(WrongSinTimes.apply, (tx, ty))
    with pytest.raises(GradcheckError) as got:
        gradcheck(sin_times(scale_y=1.1), inputs())
    assert str(got.value).splitlines()[0] == str(want.value).splitlines()[0]
    numerical = str(got.value).split("numerical:")[1].split("analytical:")[0]
    rows = [[float(v) for v in line.strip(" []").split()] for line in numerical.splitlines()]
    # rows are input elements, columns output elements: d(sin(x) * y)_j / dy_i
    np.testing.assert_allclose(rows, np.diag(np.sin(X)), atol=1e-6)


def test_returns_false_without_raising():
    assert gradcheck(sin_times(scale_x=2.0), inputs(), raise_exception=False) is False
    assert gradcheck(sin_times(), inputs(), raise_exception=False) is True


def test_float32_inputs_get_torchs_warning(torch):
    with pytest.warns(UserWarning, match="not a double precision"):
        torch.autograd.gradcheck(torch.sin, torch.ones(2, requires_grad=True),
                                 raise_exception=False)
    with pytest.warns(UserWarning, match=r"Input #1 is float32, not double precision"):
        gradcheck(lambda n, x: jnp.sin(x) * n, (2, jnp.ones(2, jnp.float32)),
                  raise_exception=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradcheck(jnp.sin, jnp.ones(2))  # float64: no warning


def test_checks_a_jitted_function_with_non_array_inputs():
    def f(x, power, index):
        return jnp.sin(x) ** power * index.astype(x.dtype)

    assert gradcheck(jax.jit(f, static_argnums=1), (jnp.asarray(X), 3, jnp.arange(3)))


def test_several_outputs_and_forward_mode():
    def f(x, y):
        return x * y.sum(), jnp.sin(y) * x.sum(), jnp.argmax(x)

    assert gradcheck(f, inputs(), check_forward_ad=True, check_batched_grad=True,
                     check_batched_forward_grad=True)
    assert gradcheck(f, inputs(), check_forward_ad=True, fast_mode=True)


def test_forward_ad_catches_a_wrong_jvp_rule():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda primals, tangents: (jnp.sin(primals[0]), 2 * jnp.cos(primals[0])
                                        * tangents[0]))
    with pytest.raises(GradcheckError, match="Jacobian computed with forward mode mismatch "
                                             "for output 0 with respect to input 0"):
        gradcheck(f, jnp.asarray(X), check_forward_ad=True, check_backward_ad=False)


def test_batched_grad_catches_a_backward_vmap_cannot_batch():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def bwd(cos, ct):
        if float(jnp.abs(ct).sum()) >= 0:  # Python control flow on a value
            return (ct * cos,)
        return (ct,)

    f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), bwd)
    assert gradcheck(f, jnp.asarray(X))
    with pytest.raises(GradcheckError, match="While computing batched gradients"):
        gradcheck(f, jnp.asarray(X), check_batched_grad=True)


def test_undefined_grad_catches_a_backward_that_needs_every_output_grad():
    @jax.custom_vjp
    def sin_cos(x):
        return jnp.sin(x), jnp.cos(x)

    def bwd(x, cts):
        d_sin, d_cos = cts  # symbolic zeros arrive as SymbolicZero objects
        return (d_sin * jnp.cos(x) - d_cos * jnp.sin(x),)

    sin_cos.defvjp(lambda x: (sin_cos(x.value), x.value), bwd, symbolic_zeros=True)
    with pytest.raises(GradcheckError, match="undefined output gradient: with output 0 unused"):
        gradcheck(sin_cos, jnp.asarray(X))
    assert gradcheck(sin_cos, jnp.asarray(X), check_undefined_grad=False)


def test_nondeterministic_backward_within_nondet_tol():
    rng = np.random.default_rng(0)

    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)),
             lambda cos, ct: (ct * cos * (1 + 1e-9 * rng.random()),))
    with pytest.raises(GradcheckError, match="not reentrant"):
        gradcheck(f, jnp.asarray(X))
    assert gradcheck(f, jnp.asarray(X), nondet_tol=1e-6)


def test_gradgradcheck_passes_smooth_functions():
    def f(x, y):
        return x * x * y, jnp.sin(x * y)

    assert gradgradcheck(f, inputs(), check_fwd_over_rev=True)
    grad_outputs = (jnp.ones(3), jnp.full(3, -0.5))
    assert gradgradcheck(f, inputs(), grad_outputs, fast_mode=True)


def test_gradgradcheck_catches_a_backward_whose_own_derivative_is_wrong():
    @jax.custom_vjp
    def cube(x):
        return x ** 3

    # Right values, but the backward hides its dependence on x from differentiation.
    cube.defvjp(lambda x: (x ** 3, x), lambda x, ct: (3 * ct * jax.lax.stop_gradient(x) ** 2,))
    assert gradcheck(cube, jnp.asarray(X))
    with pytest.raises(GradcheckError, match="with respect to input 0"):
        gradgradcheck(cube, jnp.asarray(X))
    assert gradgradcheck(cube, jnp.asarray(X), raise_exception=False) is False


@pytest.mark.parametrize("kwargs, match", [
    (dict(check_forward_ad=False, check_backward_ad=False), "at least one of"),
    (dict(check_batched_grad=True, check_backward_ad=False, check_forward_ad=True),
     "check_batched_grad=True needs check_backward_ad=True"),
    (dict(check_batched_forward_grad=True), "needs check_forward_ad=True"),
])
def test_conflicting_flags_raise_as_torch(kwargs, match):
    with pytest.raises(AssertionError, match=match):
        gradcheck(jnp.sin, jnp.ones(2), **kwargs)
    with pytest.raises(ValueError, match=match):
        gradcheck(jnp.sin, jnp.ones(2), **kwargs)


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one floating-point array"):
        gradcheck(lambda n: jnp.ones(2) * n, (jnp.arange(2),))
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lambda x: gradcheck(jnp.sin, x))(jnp.ones(2))
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        gradcheck(jnp.sin, jnp.ones(2), eps=0.0)
    with pytest.raises(TypeError, match="fast_mode must be True or False"):
        gradcheck(jnp.sin, jnp.ones(2), fast_mode="yes")
    with pytest.raises(ValueError, match=r"grad_outputs\[0\] has shape \(2,\)"):
        gradgradcheck(jnp.sin, jnp.ones(3), jnp.ones(2))


def mul_sin_function(scale_y=1.0):
    """`sin(x) * y` as a `jamp.autograd.Function`, its backward wrong by `scale_y` when != 1."""
    from jamp.autograd.function import Function

    class MulSin(Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x, y)
            return jnp.sin(x) * y

        @staticmethod
        def backward(ctx, grad):
            x, y = ctx.saved_tensors
            return grad * jnp.cos(x) * y, grad * jnp.sin(x) * scale_y

    return MulSin


@pytest.mark.parametrize("fast_mode", [False, True])
def test_function_backward_right_and_wrong(fast_mode):
    assert gradcheck(mul_sin_function().apply, inputs(), fast_mode=fast_mode,
                     check_batched_grad=True)
    with pytest.raises(GradcheckError, match="Jacobian mismatch for output 0 with respect to "
                                             "input 1"):
        gradcheck(mul_sin_function(scale_y=0.9).apply, inputs(), fast_mode=fast_mode)


def test_function_backward_is_differentiable_again():
    assert gradgradcheck(mul_sin_function().apply, inputs())


def keeps_shape_until_nudged(x):
    """x twice, (2,), at X[:1]; x itself, (1,), once x[0] moves above X[0] (Python control
    flow). The differences of a (2,) and a (1,) output broadcast to the right Jacobian."""
    return x if x[0] > X[0] else jnp.concatenate([x, x])


def keeps_dtype_until_nudged(x):
    return x.astype(jnp.float32) if x[0] > X[0] else x


CHANGING = {"shape": (keeps_shape_until_nudged, r"shape \(2,\) at the inputs but \(1,\)"),
            "dtype": (keeps_dtype_until_nudged, "dtype float64 at the inputs but float32")}


@pytest.mark.parametrize("raise_exception", [True, False])
@pytest.mark.parametrize("fast_mode", [False, True])
@pytest.mark.parametrize("change", CHANGING.values(), ids=CHANGING)
def test_an_output_that_changes_when_an_input_is_nudged_is_an_error(change, fast_mode,
                                                                     raise_exception):
    # Finite differences of outputs of different shapes broadcast into a wrong Jacobian (a
    # silent pass for shapes); torch asserts that perturbed outputs keep shape and dtype, and
    # raises also with raise_exception=False: a misuse, not a failed check.
    func, match = change
    with pytest.raises(PerturbedOutputError, match=f"output 0 has {match} with input 0 "
                                                   "perturbed") as info:
        gradcheck(func, jnp.asarray(X[:1]), fast_mode=fast_mode,
                  raise_exception=raise_exception)
    assert isinstance(info.value, AssertionError)  # torch's type


def test_torch_asserts_perturbed_outputs_keep_shape_and_dtype(torch):
    x = torch.tensor(X[:1], requires_grad=True)
    for func in (lambda x: x if x[0] > X[0] else torch.cat([x, x]),
                 lambda x: x.float() if x[0] > X[0] else x):
        with pytest.raises(AssertionError, match="same (shape|dtype) when inputs are perturbed"):
            torch.autograd.gradcheck(func, (x,), raise_exception=False)
