"""jamp.autograd.Function at the edges torch's own tests reach: forward's default arguments
under setup_context, ctx.saved_tensors in jvp, and jvp tangents for non-differentiable outputs.
Each is held against torch.autograd.Function running the same class live."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp.autograd.function import Function

A = jnp.array([0.5, -1.0, 2.0])


def _torch_tangent(torch, cls, x, t):
    """The forward-mode tangent of `cls.apply(x)` in torch, for tangent `t`."""
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():
        dual = fwad.make_dual(torch.tensor(np.asarray(x)), torch.tensor(np.asarray(t)))
        out = cls.apply(dual)
        return fwad.unpack_dual(out).tangent.numpy()


# -- setup_context receives forward's defaults bound ---------------------------------------


def _scale_with_default(base, record):
    class Scale(base):
        @staticmethod
        def forward(x, y=3.0):
            return x * y

        @staticmethod
        def setup_context(ctx, inputs, output):
            record.append(len(inputs))
            x, y = inputs
            ctx.y = y

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output * ctx.y, None

    return Scale


def test_setup_context_gets_forward_defaults_bound_as_in_torch(torch):
    want_record: list = []
    TorchScale = _scale_with_default(torch.autograd.Function, want_record)
    t = torch.tensor(np.asarray(A), requires_grad=True)
    (want,) = torch.autograd.grad(TorchScale.apply(t).sum(), t)

    record: list = []
    Scale = _scale_with_default(Function, record)
    got = jax.grad(lambda x: Scale.apply(x).sum())(A)
    np.testing.assert_allclose(got, want.numpy())
    assert record[-1] == want_record[-1] == 2


# -- ctx.saved_tensors in jvp --------------------------------------------------------------


def _square_saving_for_backward(base, seen):
    class Square(base):
        @staticmethod
        def forward(x):
            return x * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            (x,) = inputs
            ctx.save_for_backward(x)
            ctx.x = x

        @staticmethod
        def backward(ctx, grad_output):
            (x,) = ctx.saved_tensors
            return 2 * x * grad_output

        @staticmethod
        def jvp(ctx, x_t):
            seen.append(ctx.saved_tensors)
            return 2 * ctx.x * x_t

    return Square


def test_saved_tensors_in_jvp_without_save_for_forward_is_empty_as_in_torch(torch):
    want_seen: list = []
    TorchSquare = _square_saving_for_backward(torch.autograd.Function, want_seen)
    want = _torch_tangent(torch, TorchSquare, A, jnp.ones(3))

    seen: list = []
    Square = _square_saving_for_backward(Function, seen)
    _, got = jax.jvp(Square.apply, (A,), (jnp.ones(3),))
    np.testing.assert_allclose(got, want)
    assert seen[-1] == want_seen[-1] == ()


# -- a jvp's tangent for a non-differentiable output ---------------------------------------


def _with_marked_output(base, marked_tangent=lambda x_t: x_t.sum()):
    """A Function (of `base`, jamp's or torch's) whose second output is marked
    non-differentiable and whose jvp returns `marked_tangent(x_t)` for it."""

    class Split(base):
        @staticmethod
        def forward(x):
            return x * 2, x.sum()

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.mark_non_differentiable(output[1])

        @staticmethod
        def jvp(ctx, x_t):
            return x_t * 2, marked_tangent(x_t)  # torch's rule: None for the marked output

    return Split


def test_jvp_tangent_for_a_marked_output_raises_as_in_torch(torch):
    with pytest.raises(RuntimeError, match="not a differentiable") as want:
        _torch_tangent(torch, _with_marked_output(torch.autograd.Function), A, jnp.ones(3))
    assert "return None" in str(want.value)

    Split = _with_marked_output(Function)
    with pytest.raises(RuntimeError, match="non-differentiable.*return None"):
        jax.jvp(Split.apply, (A,), (jnp.ones(3),))


def test_jvp_returning_none_for_a_marked_output_gives_it_a_zero_tangent():
    Split = _with_marked_output(Function, marked_tangent=lambda x_t: None)
    _, (t, t_sum) = jax.jvp(Split.apply, (A,), (jnp.ones(3),))
    np.testing.assert_allclose(t, 2 * np.ones(3))
    assert float(t_sum) == 0.0
