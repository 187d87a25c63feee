"""jamp.autograd.functional against torch.autograd.functional (CPU build, the test-only oracle):
the same values in float64, the same structures (single and tuple inputs and outputs), the same
errors for `v`, `strict` and option combinations; eagerly and under jit."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp.autograd import functional as F

pytestmark = pytest.mark.usefixtures("x64")


@pytest.fixture
def TF(torch):
    """torch.autograd.functional, the oracle."""
    return torch.autograd.functional

X = np.array([0.3, -1.2])
Y = np.array([0.5, 2.0, -0.7])


# Each function is written once for both libraries: `m` is jnp or torch. Few distinct
# operations, so that eager runs compile few kernels.
def one_to_one(m):
    return lambda x: m.sin(x) * x


def two_to_one(m):
    return lambda x, y: m.sin(x) * y.sum()


def one_to_two(m):
    return lambda x: (m.sin(x), (x * x).sum())


def two_to_two(m):
    return lambda x, y: (x * y.sum(), m.sin(y) * x.sum())


def scalar_of_one(m):
    return lambda x: (m.sin(x) * x * x).sum()


def scalar_of_two(m):
    return lambda x, y: (m.sin(x) * x).sum() * (y * y * y).sum()


CASES = {  # name: (function, inputs)
    "one-to-one": (one_to_one, (X,)),
    "two-to-one": (two_to_one, (X, Y)),
    "one-to-two": (one_to_two, (X,)),
    "two-to-two": (two_to_two, (X, Y)),
}
SCALAR_CASES = {"one": (scalar_of_one, (X,)), "two": (scalar_of_two, (X, Y))}


def as_torch(torch, arrays, single):
    out = tuple(torch.tensor(np.asarray(a)) for a in arrays)
    return out[0] if single else out


def as_jax(arrays, single):
    out = tuple(jnp.asarray(a) for a in arrays)
    return out[0] if single else out


def assert_same(got, want):
    """Same structure (tuples where torch has tuples), shapes, float64, values. torch's
    forward-mode jacobian returns lists where its documentation promises tuples: jamp returns
    the tuples."""
    if isinstance(want, (tuple, list)):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
        return
    assert isinstance(got, jax.Array), type(got)
    assert got.dtype == jnp.float64
    chex.assert_shape(got, tuple(want.shape))
    np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=1e-12, atol=1e-12)


def call_both(torch, jamp_call, torch_call, case, variant):
    """Runs `jamp_call(jamp_inputs)` (under `variant`) and `torch_call(torch_inputs)` for a case
    and checks they agree."""
    fn, arrays = case
    single = len(arrays) == 1
    got = variant(lambda *xs: jamp_call(fn(jnp), xs[0] if single else xs))(
        *as_jax(arrays, False))
    want = torch_call(fn(torch), as_torch(torch, arrays, single))
    assert_same(got, want)


# -- values and structures --------------------------------------------------------------------

@pytest.mark.parametrize("name", CASES)
def test_jacobian_matches_torch(torch, TF, name, variant):
    call_both(torch, F.jacobian, TF.jacobian, CASES[name], variant)


@pytest.mark.parametrize("name", ["one-to-two", "two-to-two"])
def test_forward_mode_jacobian_matches_torch(torch, TF, name, variant):
    call_both(torch, lambda f, x: F.jacobian(f, x, vectorize=True, strategy="forward-mode"),
              lambda f, x: TF.jacobian(f, x, vectorize=True, strategy="forward-mode"),
              CASES[name], variant)


@pytest.mark.parametrize("name", SCALAR_CASES)
def test_hessian_matches_torch(torch, TF, name, variant):
    call_both(torch, F.hessian, TF.hessian, SCALAR_CASES[name], variant)


def test_forward_over_reverse_hessian_matches_torch(torch, TF):
    call_both(torch, lambda f, x: F.hessian(f, x, vectorize=True,
                                     outer_jacobian_strategy="forward-mode"),
              lambda f, x: TF.hessian(f, x, vectorize=True,
                                      outer_jacobian_strategy="forward-mode"),
              SCALAR_CASES["two"], jax.jit)


def test_hessian_of_a_one_element_output_has_the_inputs_shape(torch, TF):
    call_both(torch, F.hessian, TF.hessian, (lambda m: lambda x: (x ** 3).sum().reshape(1, 1), (X,)),
              lambda f: f)


def _v_like(structure):
    """A v for each array of a structure: fixed, non-trivial values."""
    if isinstance(structure, tuple):
        return tuple(_v_like(s) for s in structure)
    return np.linspace(-1.0, 1.5, int(np.prod(structure.shape))).reshape(structure.shape)


@pytest.mark.parametrize("name", CASES)
def test_vjp_matches_torch(torch, TF, name, variant):
    fn, arrays = CASES[name]
    v = _v_like(fn(torch)(*as_torch(torch, arrays, False)))

    def to(lib, value):
        if isinstance(value, tuple):
            return tuple(to(lib, x) for x in value)
        return jnp.asarray(value) if lib == "jax" else torch.tensor(value)

    call_both(torch, lambda f, x: F.vjp(f, x, to("jax", v)),
              lambda f, x: TF.vjp(f, x, to("torch", v)), CASES[name], variant)


@pytest.mark.parametrize("name", CASES)
def test_jvp_matches_torch(torch, TF, name, variant):
    fn, arrays = CASES[name]
    single = len(arrays) == 1
    v = tuple(_v_like(a) for a in arrays)
    call_both(torch, lambda f, x: F.jvp(f, x, as_jax(v, single)),
              lambda f, x: TF.jvp(f, x, as_torch(torch, v, single)), CASES[name], variant)


@pytest.mark.parametrize("which", ["hvp", "vhp"])
@pytest.mark.parametrize("name", SCALAR_CASES)
def test_hvp_and_vhp_match_torch(torch, TF, name, which, variant):
    fn, arrays = SCALAR_CASES[name]
    single = len(arrays) == 1
    v = tuple(_v_like(a) for a in arrays)
    call_both(torch, lambda f, x: getattr(F, which)(f, x, as_jax(v, single)),
              lambda f, x: getattr(TF, which)(f, x, as_torch(torch, v, single)),
              SCALAR_CASES[name], variant)


def test_v_may_be_none_for_a_single_element(torch, TF):
    scalar = (scalar_of_one, (X,))
    call_both(torch, F.vjp, TF.vjp, scalar, lambda f: f)
    one = (lambda m: lambda x: (m.sin(x) * x, x ** 2), (np.array([0.4]),))
    call_both(torch, F.jvp, TF.jvp, one, lambda f: f)
    call_both(torch, F.hvp, TF.hvp, (lambda m: lambda x: (x ** 4).sum(), (np.array([[0.7]]),)),
              lambda f: f)


def test_an_integer_output_carries_no_gradient_as_in_torch(torch, TF, variant):
    x, v = torch.tensor(X), (torch.ones(2, dtype=torch.float64), torch.tensor(5))
    want = TF.vjp(lambda a: (a * 2, a.argmax()), x, v)[1]
    got = variant(lambda a: F.vjp(lambda b: (b * 2, jnp.argmax(b)), a,
                                  (jnp.ones(2), jnp.array(5)))[1])(jnp.asarray(X))
    np.testing.assert_array_equal(got, want.numpy())


def test_results_are_differentiable_again_as_with_create_graph(torch, TF):
    """d/dx sum(jacobian(f)(x)) and d/dx sum(vhp): torch's create_graph=True backward."""
    x = torch.tensor(X, requires_grad=True)
    TF.jacobian(one_to_two(torch), x, create_graph=True)[0].sum().backward()
    got = jax.grad(lambda a: F.jacobian(one_to_two(jnp), a, create_graph=True)[0].sum())(
        jnp.asarray(X))
    np.testing.assert_allclose(got, x.grad.numpy(), rtol=1e-12)

    x = torch.tensor(X, requires_grad=True)
    TF.vhp(scalar_of_one(torch), x, torch.ones(2), create_graph=True)[1].sum().backward()
    got = jax.grad(lambda a: F.vhp(scalar_of_one(jnp), a, jnp.ones(2))[1].sum())(jnp.asarray(X))
    np.testing.assert_allclose(got, x.grad.numpy(), rtol=1e-12)


def test_under_vmap(torch, TF):
    xs = jnp.stack([jnp.asarray(X), 2 * jnp.asarray(X)])
    got = jax.vmap(lambda x: F.jacobian(one_to_one(jnp), x))(xs)
    for x, jac in zip(xs, got):
        want = TF.jacobian(one_to_one(torch), torch.tensor(np.asarray(x)))
        np.testing.assert_allclose(jac, want.numpy(), rtol=1e-12)


def _sin_with_custom_vjp():
    @jax.custom_vjp
    def sin(x):
        return jnp.sin(x)

    sin.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda cos, ct: (ct * cos,))
    return sin


def test_jvp_through_a_custom_vjp(variant):
    """jax.jvp refuses a custom_vjp; torch's double-backward method (jvp from the vjp) does not."""
    v = jnp.array([1.0, -2.0])
    out, tangent = variant(lambda x: F.jvp(_sin_with_custom_vjp(), x, v))(jnp.asarray(X))
    np.testing.assert_allclose(out, np.sin(X), rtol=1e-12)
    np.testing.assert_allclose(tangent, np.cos(X) * np.asarray(v), rtol=1e-12)


def test_hvp_through_a_custom_vjp(variant):
    out, product = variant(lambda x: F.hvp(lambda a: _sin_with_custom_vjp()(a).sum(), x,
                                           jnp.ones(2)))(jnp.asarray(X))
    np.testing.assert_allclose(product, -np.sin(X), rtol=1e-12)


# -- errors -----------------------------------------------------------------------------------

def both_raise(torch, jamp_call, torch_call, error, match):
    """torch raises `error` for the call, and so does jamp, with a message matching `match`."""
    with pytest.raises(error):
        torch_call(torch)
    with pytest.raises(error, match=match):
        jamp_call(jnp)


def arrays(m, *values):
    return tuple((jnp.asarray if m is jnp else m.tensor)(np.asarray(v, float))
                 for v in values)


V_ERRORS = {  # name: (call(functional module, m), message)
    "vjp-v-none": (lambda F, m: F.vjp(lambda x: x ** 2, *arrays(m, X)),
                   "v can only be None if the user-provided function returns a single array "
                   "with a single element"),
    "jvp-v-none": (lambda F, m: F.jvp(lambda x: x ** 2, *arrays(m, X)),
                   "v can only be None if the input to the user-provided function is a single"),
    "hvp-v-none": (lambda F, m: F.hvp(lambda x: (x ** 2).sum(), *arrays(m, X)),
                   "v can only be None if the input"),
    "vhp-v-none": (lambda F, m: F.vhp(lambda x: (x ** 2).sum(), *arrays(m, X)),
                   "v can only be None if the input"),
    "v-tuple-length": (lambda F, m: F.vjp(lambda x: (x, x), *arrays(m, X), arrays(m, X)),
                       r"v is a tuple of invalid length: should be 2 but got 1"),
    "v-single": (lambda F, m: F.vjp(lambda x: x, *arrays(m, X), arrays(m, X, X)),
                 "The given v should contain a single array"),
    "v-size": (lambda F, m: F.vjp(lambda x: x, *arrays(m, X), *arrays(m, Y)),
               r"v has invalid size: should be \(2,\) but got \(3,\)"),
    "v-entry-size": (lambda F, m: F.jvp(lambda x, y: x, arrays(m, X, Y), arrays(m, X, X)),
                     r"Entry 1 in v has invalid size: should be \(3,\) but got \(2,\)"),
}


@pytest.mark.parametrize("name", V_ERRORS)
def test_v_errors_as_torch(torch, TF, name):
    call, match = V_ERRORS[name]
    both_raise(torch, lambda m: call(F, m), lambda m: call(TF, m), RuntimeError, match)


def _detached(m):
    return (lambda x: jax.lax.stop_gradient(x) * 2) if m is jnp else (lambda x: x.detach() * 2)


def _through_bool(m):
    return (lambda x: (x > 0).astype(x.dtype)) if m is jnp else (lambda x: (x > 0).to(x.dtype))


STRICT_ERRORS = {  # name: (call(functional module, m), message)
    "vjp-unused-input": (lambda F, m: F.vjp(lambda x, y: x * 2, arrays(m, X, Y),
                                            *arrays(m, X), strict=True),
                         "The output of the user-provided function is independent of input 1"),
    "vjp-constant-output": (lambda F, m: F.vjp(lambda x: (x * 2, m.ones(())),
                                               *arrays(m, X), arrays(m, X, 1.0), strict=True),
                            "Output 1 of the user-provided function does not require "
                            "gradients"),
    "vjp-detached": (lambda F, m: F.vjp(_detached(m), *arrays(m, X), *arrays(m, X),
                                        strict=True),
                     "Output 0 of the user-provided function does not require gradients"),
    "vjp-through-bool": (lambda F, m: F.vjp(_through_bool(m), *arrays(m, X), *arrays(m, X),
                                            strict=True),
                         "Output 0 of the user-provided function does not require gradients"),
    "vjp-linear-create-graph": (lambda F, m: F.vjp(lambda x: x * 2, *arrays(m, X),
                                                   *arrays(m, X), strict=True,
                                                   create_graph=True),
                                "The jacobian of the user-provided function with respect to "
                                "input 0 is independent of the inputs.*create_graph=True"),
    "jvp-unused-input": (lambda F, m: F.jvp(lambda x, y: x * 2, arrays(m, X, Y),
                                            arrays(m, X, Y), strict=True),
                         "independent of input 1"),
    "jvp-linear-create-graph": (lambda F, m: F.jvp(lambda x: (x * 2, x ** 2), *arrays(m, X),
                                                   *arrays(m, X), strict=True,
                                                   create_graph=True),
                                "for output 0 of the user-provided function is independent"),
    "jacobian-unused-input": (lambda F, m: F.jacobian(lambda x, y: (x * 2, y * x.sum()),
                                                      arrays(m, X, Y), strict=True),
                              "Output 0 of the user-provided function is independent of "
                              "input 1"),
    "hessian-separable": (lambda F, m: F.hessian(lambda x, y: (x ** 2).sum() + (y ** 2).sum(),
                                                 arrays(m, X, Y), strict=True),
                          "with respect to input 0 is independent of input 1"),
    "hessian-unused-input": (lambda F, m: F.hessian(lambda x, y: (x ** 3).sum(),
                                                    arrays(m, X, Y), strict=True),
                             "the jacobian of the user-provided function with respect to input "
                             "1 is independent of the input"),
    "hessian-linear": (lambda F, m: F.hessian(lambda x: (x * 2).sum(), *arrays(m, X),
                                              strict=True),
                       "with respect to input 0 is independent of the input"),
    "vhp-unused-input": (lambda F, m: F.vhp(lambda x, y: (x ** 3).sum(), arrays(m, X, Y),
                                            arrays(m, X, Y), strict=True),
                         "The output of the user-provided function is independent of input 1"),
    "hvp-linear": (lambda F, m: F.hvp(lambda x: (x * 2).sum(), *arrays(m, X), *arrays(m, X),
                                      strict=True),
                   "found that the jacobian of the user-provided function with respect to "
                   "input 0 is independent"),
}


@pytest.mark.parametrize("name", STRICT_ERRORS)
def test_strict_errors_as_torch(torch, TF, name):
    call, match = STRICT_ERRORS[name]
    both_raise(torch, lambda m: call(F, m), lambda m: call(TF, m), RuntimeError, match)


def test_strict_raises_under_jit():
    with pytest.raises(RuntimeError, match="independent of input 1"):
        jax.jit(lambda x, y: F.vjp(lambda a, b: a * 2, (x, y), x, strict=True))(
            jnp.asarray(X), jnp.asarray(Y))


STRICT_PASSES = {  # what torch lets through in strict mode, and so does jamp
    "floor": lambda F, m: F.vjp(lambda x: m.floor(x), *arrays(m, X), *arrays(m, X),
                                strict=True),
    "separable-vhp": lambda F, m: F.vhp(lambda x, y: (x ** 3).sum() + (y ** 3).sum(),
                                        arrays(m, X, Y), arrays(m, X, Y), strict=True),
    "quadratic-hessian-create-graph": lambda F, m: F.hessian(
        lambda x: (x ** 2).sum(), *arrays(m, X), strict=True, create_graph=True),
    "jacobian": lambda F, m: F.jacobian(lambda x, y: x * y.sum(), arrays(m, X, Y),
                                        strict=True),
}


@pytest.mark.parametrize("name", STRICT_PASSES)
def test_strict_passes_as_torch(torch, TF, name, variant):
    STRICT_PASSES[name](TF, torch)
    variant(lambda: STRICT_PASSES[name](F, jnp))()


def test_strict_sees_through_nested_jit_and_custom_vjp():
    inner = jax.jit(lambda a, b: (a * 2, b * 3))
    with pytest.raises(RuntimeError, match="Output 0 of the user-provided function is "
                                           "independent of input 1"):
        F.jacobian(lambda x, y: inner(x, y), (jnp.asarray(X), jnp.asarray(Y)), strict=True)
    F.vjp(_sin_with_custom_vjp(), jnp.asarray(X), jnp.ones(2), strict=True)



def test_strict_sees_bfloat16_and_float16_values_require_grad():
    # torch: a half tensor computed from one that requires grad requires grad too.
    for dtype in (jnp.bfloat16, jnp.float16):
        x = jnp.ones(2, dtype)
        _, grad = F.vjp(lambda a: a * 2, x, x, strict=True)
        assert grad.dtype == dtype


OPTION_ERRORS = {  # name: (call(functional module, m), error, message)
    "forward-needs-vectorize": (
        lambda F, m: F.jacobian(lambda x: x, *arrays(m, X), strategy="forward-mode"),
        NotImplementedError, "needs `vectorize=True`"),
    "forward-not-strict": (
        lambda F, m: F.jacobian(lambda x: x, *arrays(m, X), strategy="forward-mode",
                                vectorize=True, strict=True),
        RuntimeError, "`strict=True` and `strategy=\"forward-mode\"`"),
    "forward-not-create-graph": (
        lambda F, m: F.jacobian(lambda x: x, *arrays(m, X), strategy="forward-mode",
                                vectorize=True, create_graph=True),
        NotImplementedError, "`create_graph=True` and `strategy=\"forward-mode\"`"),
    "strict-not-vectorize": (
        lambda F, m: F.jacobian(lambda x: x, *arrays(m, X), strict=True, vectorize=True),
        RuntimeError, "`strict=True` and `vectorize=True`"),
    "hessian-forward-needs-vectorize": (
        lambda F, m: F.hessian(lambda x: (x ** 3).sum(), *arrays(m, X),
                               outer_jacobian_strategy="forward-mode"),
        NotImplementedError, "outer_jacobian_strategy=\"forward-mode\"` needs"),
    "bad-strategy": (lambda F, m: F.jacobian(lambda x: x, *arrays(m, X), strategy="fwd"),
                     AssertionError, "strategy must be \"forward-mode\" or \"reverse-mode\""),
    "list-inputs": (lambda F, m: F.vjp(lambda x: x, list(arrays(m, X))),
                    TypeError, "inputs given to vjp must be either an array or a tuple of "
                               "arrays, but the given inputs has type <class 'list'>"),
    "list-outputs": (lambda F, m: F.vjp(lambda x: [x, x], *arrays(m, X), arrays(m, X, X)),
                     TypeError, "outputs of the user-provided function given to vjp"),
    "hessian-of-a-vector": (lambda F, m: F.hessian(lambda x: x ** 3, *arrays(m, X)),
                            RuntimeError, "should contain a single element"),
    "hessian-of-a-tuple": (lambda F, m: F.hessian(lambda x: ((x ** 3).sum(),), *arrays(m, X)),
                           RuntimeError, "should return a single array"),
    "vhp-of-a-vector": (lambda F, m: F.vhp(lambda x: x ** 3, *arrays(m, X), *arrays(m, X)),
                        RuntimeError, "given to vhp should contain a single element"),
}


@pytest.mark.parametrize("name", OPTION_ERRORS)
def test_option_errors_as_torch(torch, TF, name):
    call, error, match = OPTION_ERRORS[name]
    both_raise(torch, lambda m: call(F, m), lambda m: call(TF, m), error, match)


def test_a_bad_strategy_is_also_a_value_error():
    with pytest.raises(ValueError, match="got strategy='fwd'"):
        F.jacobian(lambda x: x, jnp.asarray(X), strategy="fwd")


@pytest.mark.parametrize("flag", ["create_graph", "strict", "vectorize"])
def test_flags_must_be_bools(flag):
    with pytest.raises(TypeError, match=f"{flag} must be True or False"):
        F.jacobian(lambda x: x, jnp.asarray(X), **{flag: "yes"})


def test_integer_inputs_are_refused():
    with pytest.raises(TypeError, match="Input 0 given to jacobian has dtype int"):
        F.jacobian(lambda x: x * 2, jnp.arange(3))


def test_jvp_through_a_function_with_only_a_backward(torch, TF):
    """torch's jvp (double backward) works on a Function without a forward rule: so does
    jamp's, through the vjp's transpose."""
    from jamp.autograd.function import Function

    class TorchSin(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return torch.sin(x)

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * torch.cos(x)

    class Sin(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return jnp.sin(x)

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * jnp.cos(x)

    v = np.array([1.0, -2.0])
    call_both(torch, lambda f, x: F.jvp(f, x, jnp.asarray(v)),
              lambda f, x: TF.jvp(f, x, torch.tensor(v)),
              (lambda m: TorchSin.apply if m is torch else Sin.apply, (X,)), jax.jit)
