"""Tensor hooks and grad mode: `register_hook` clips, replaces and logs gradients and leaves them
unchanged when the hook returns None; `no_grad`-style decorators give zero gradients and their
`with` forms are honest (a no-op eagerly, an error inside a trace); forward-mode AD's dual API
matches `jax.jvp` and torch.autograd.forward_ad in float64. Eagerly and under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp.autograd import forward_ad as fwAD
from jamp.autograd.grad_mode import (enable_grad, inference_mode, no_grad, register_hook,
                                     set_grad_enabled)

X = jnp.array([0.5, -2.0, 3.0])
T = jnp.array([1.0, 0.5, -1.0])


def scaled(x, hook):
    return (3.0 * register_hook(x, hook) ** 2).sum()


def plain(x):
    return (3.0 * x ** 2).sum()


# -- register_hook ----------------------------------------------------------------------------

def test_hook_clips_the_gradient(variant):
    grads = variant(jax.grad(lambda x: scaled(x, lambda g: jnp.clip(g, -1.0, 1.0))))(X)
    np.testing.assert_array_equal(grads, jnp.clip(jax.grad(plain)(X), -1.0, 1.0))


def test_hook_replaces_the_gradient(variant):
    grads = variant(jax.grad(lambda x: scaled(x, lambda g: jnp.ones_like(g))))(X)
    np.testing.assert_array_equal(grads, jnp.ones_like(X))


def test_hook_returning_none_leaves_the_gradient_unchanged(variant):
    grads = variant(jax.grad(lambda x: scaled(x, lambda g: None)))(X)
    np.testing.assert_array_equal(grads, jax.grad(plain)(X))
    np.testing.assert_array_equal(variant(lambda x: scaled(x, lambda g: None))(X), plain(X))


def test_hook_logs_every_step_under_jit(variant):
    seen = []

    def log(g):
        jax.debug.callback(lambda g: seen.append(np.asarray(g)), g)

    step = variant(jax.grad(lambda x: scaled(x, log)))
    for _ in range(2):
        jax.block_until_ready(step(X))
    jax.effects_barrier()
    assert len(seen) == 2
    np.testing.assert_allclose(seen[0], 6.0 * X)


def test_hook_on_a_pytree_and_in_the_middle():
    def loss(params, x):
        h = params["w"] * x
        h = register_hook(h, lambda g: 2.0 * g)  # doubles what flows back into params
        return jnp.sum(h ** 2)

    params = {"w": X}
    want = jax.tree_util.tree_map(lambda g: 2.0 * g,
                                  jax.grad(lambda p, x: jnp.sum((p["w"] * x) ** 2))(params, T))
    np.testing.assert_allclose(jax.grad(loss)(params, T)["w"], want["w"], rtol=1e-6)

    tree_hook = lambda g: {"a": g["a"], "b": jnp.zeros_like(g["b"])}  # noqa: E731
    grads = jax.grad(lambda t: sum(v.sum() for v in register_hook(t, tree_hook).values()))(
        {"a": X, "b": T})
    np.testing.assert_array_equal(grads["b"], jnp.zeros_like(T))
    np.testing.assert_array_equal(grads["a"], jnp.ones_like(X))


def test_hook_is_not_called_without_a_gradient():
    calls = []

    def loss(x):
        register_hook(x * 2.0, calls.append)  # its value is unused
        return x.sum()

    np.testing.assert_array_equal(jax.grad(loss)(X), jnp.ones_like(X))
    assert calls == []


def test_forward_mode_passes_through_a_hook():
    out, tangent = jax.jvp(lambda x: scaled(x, lambda g: 0.0 * g), (X,), (T,))
    _, want = jax.jvp(plain, (X,), (T,))
    np.testing.assert_allclose(tangent, want, rtol=1e-6)


def test_hook_errors():
    with pytest.raises(TypeError, match="no gradient"):
        register_hook(jnp.arange(3), lambda g: g)
    with pytest.raises(TypeError, match="callable"):
        register_hook(X, None)
    with pytest.raises(ValueError, match="shape"):
        jax.grad(lambda x: scaled(x, lambda g: g[:1]))(X)
    with pytest.raises(TypeError, match="dtype"):
        jax.grad(lambda x: scaled(x, lambda g: g.astype(jnp.float16)))(X)


# -- grad mode --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [no_grad(), set_grad_enabled(False), inference_mode()],
                         ids=["no_grad", "set_grad_enabled", "inference_mode"])
def test_decorated_outputs_have_zero_gradients(mode, variant):
    target = mode(lambda x, k: (jnp.sin(x) * k, k))
    grads = variant(jax.grad(lambda x: (x * target(x, 2)[0]).sum()))(X)
    np.testing.assert_allclose(grads, 2.0 * jnp.sin(X), rtol=1e-6)  # only the outer x's
    np.testing.assert_array_equal(jax.grad(lambda x: target(x, 2)[0].sum())(X), jnp.zeros(3))


def test_decorators_without_parentheses():
    @no_grad
    def f(x):
        return x * x

    @inference_mode
    def g(x):
        return x * x

    for fn in (f, g):
        np.testing.assert_array_equal(jax.grad(lambda x: fn(x).sum())(X), jnp.zeros(3))


def test_closed_over_values_stop_too():
    # torch's no_grad records nothing inside, parameters included.
    grads = jax.grad(lambda w: no_grad()(lambda x: (w * x).sum())(X))(2.0)
    assert grads == 0.0


def test_enabled_modes_change_nothing():
    assert enable_grad()(jnp.sin) is jnp.sin
    assert enable_grad(jnp.sin) is jnp.sin
    assert set_grad_enabled(True)(jnp.sin) is jnp.sin
    assert inference_mode(False)(jnp.sin) is jnp.sin


def test_a_grad_inside_no_grad_still_differentiates():
    @no_grad
    def inner_grad(x):
        with enable_grad():
            return jax.grad(plain)(x)

    np.testing.assert_allclose(inner_grad(X), 6.0 * X)


def test_with_blocks_are_honest():
    with no_grad(), inference_mode(), set_grad_enabled(False), enable_grad():
        y = jnp.sin(X)  # eager code: nothing records gradients anyway
    np.testing.assert_array_equal(y, jnp.sin(X))

    def traced(x):
        with no_grad():
            return jnp.sin(x)

    with pytest.raises(RuntimeError, match="Decorate a function instead"):
        jax.grad(lambda x: traced(x).sum())(X)

    def traced_enable(x):
        with enable_grad():
            return jnp.sin(x)

    np.testing.assert_allclose(jax.jit(traced_enable)(X), jnp.sin(X))


def test_grad_mode_arguments_are_checked():
    with pytest.raises(TypeError, match="mode"):
        set_grad_enabled("no")
    with pytest.raises(TypeError, match="function"):
        no_grad()(3)


# -- forward-mode AD --------------------------------------------------------------------------

def f_jnp(x, y):
    return jnp.sin(x) * y + jnp.exp(x * y)


def test_dual_level_matches_jax_jvp_eagerly():
    with fwAD.dual_level() as level:
        assert level == 0
        dual = fwAD.make_dual(X, T)
        out = f_jnp(dual, 2.0)
        primal, tangent = fwAD.unpack_dual(out)
        assert fwAD.unpack_dual(X) == fwAD.UnpackedDualTensor(X, None)
    want, want_t = jax.jvp(lambda x: f_jnp(x, 2.0), (X,), (T,))
    np.testing.assert_allclose(primal, want, rtol=1e-6)
    np.testing.assert_allclose(tangent, want_t, rtol=1e-6)


def test_dual_level_decorator_under_transforms(variant):
    @fwAD.dual_level()
    def directional(x, t):
        out = f_jnp(fwAD.make_dual(x, t), X)
        return fwAD.unpack_dual(out).tangent

    want = jax.jvp(lambda x: f_jnp(x, X), (X,), (T,))[1]
    np.testing.assert_allclose(variant(directional)(X, T), want, rtol=1e-6)
    # Reverse over forward: the gradient of a directional derivative.
    np.testing.assert_allclose(
        variant(jax.grad(lambda x: directional(x, T).sum()))(X),
        jax.grad(lambda x: jax.jvp(lambda x: f_jnp(x, X), (x,), (T,))[1].sum())(X), rtol=1e-5)


def test_dual_api_matches_torch_forward_ad(torch, x64):
    tfw = torch.autograd.forward_ad
    x = np.array([0.3, -1.2, 2.0])
    t = np.array([1.0, -0.5, 0.25])
    y = np.array([0.7, 1.5, -0.4])
    with tfw.dual_level():
        dual = tfw.make_dual(torch.tensor(x), torch.tensor(t))
        got = tfw.unpack_dual(torch.sin(dual) * torch.tensor(y) + torch.exp(dual * torch.tensor(y)))
        want_p, want_t = got.primal.numpy(), got.tangent.numpy()
    with fwAD.dual_level():
        out = fwAD.unpack_dual(f_jnp(fwAD.make_dual(jnp.asarray(x), jnp.asarray(t)),
                                     jnp.asarray(y)))
    assert out.primal.dtype == jnp.float64
    np.testing.assert_allclose(out.primal, want_p, rtol=1e-12)
    np.testing.assert_allclose(out.tangent, want_t, rtol=1e-12)


def test_nested_levels_and_manual_entry():
    outer = fwAD.enter_dual_level()
    try:
        a = fwAD.make_dual(X, T)
        with fwAD.dual_level() as inner:
            b = fwAD.make_dual(X, jnp.ones_like(X), level=inner)
            prod = fwAD.unpack_dual(a * b, level=inner)  # d/db at the inner level: a
            np.testing.assert_allclose(fwAD.unpack_dual(prod.tangent, level=outer).primal, X)
    finally:
        fwAD.exit_dual_level(level=outer)


def test_dual_errors():
    with pytest.raises(RuntimeError, match="dual level"):
        fwAD.make_dual(X, T)
    assert fwAD.unpack_dual(X).tangent is None  # outside any level
    with fwAD.dual_level():
        with pytest.raises(ValueError, match="shape and dtype"):
            fwAD.make_dual(X, T[:2])
        with pytest.raises(TypeError, match="floating"):
            fwAD.make_dual(jnp.arange(3), jnp.arange(3))
    with pytest.raises(RuntimeError, match="no dual level"):
        fwAD.exit_dual_level()
