"""torch.autograd's `gradcheck` and `gradgradcheck` for JAX: a function's derivatives, as JAX
computes them (`jax.vjp` for reverse mode, `jax.jvp` for forward mode, through any
`jax.custom_vjp` / `jax.custom_jvp` rule or `jamp.autograd.Function` inside), checked against
central finite differences.

Which inputs are checked: every array input (JAX or NumPy) of a floating-point dtype; other
inputs (Python numbers, integer arrays, anything else) are passed to `func` unchanged. JAX
arrays have no `requires_grad`, so that is the rule here. An input's index in messages is its
position in `inputs`, an output's its position in what `func` returns.

The checks, with torch's keywords and defaults:

- the Jacobian: slow mode compares full Jacobians element by element, `|analytical -
  numerical| <= atol + rtol * |numerical|`, shown as torch shows them (one row per input
  element, one column per output element); `fast_mode=True` compares `v^T J u` for random unit
  vectors u (per input) and v (per output), with `atol` scaled by `sum(u) * sum(v)` as torch
  does, and on a mismatch recomputes that pair's full Jacobians for the message.
- reentrancy: the backward runs twice and must agree within `nondet_tol`.
- backward of zero output gradients is zero, with each input's shape (and, with
  `check_grad_dtypes`, its dtype).
- `check_undefined_grad`: with several outputs, the backward still works when one output is
  unused (its gradient is JAX's symbolic zero: what torch calls undefined).
- `check_forward_ad`: the same Jacobian from `jax.jvp` columns; `check_batched_grad` /
  `check_batched_forward_grad`: `jax.vmap` of the backward / forward matches it run one vector
  at a time.

Not ported: complex inputs or outputs (JAX's complex gradients are the conjugates of torch's;
check the real and imaginary parts as real functions), and `masked` (sparse layouts; accepted,
no effect). `gen_non_contig_grad_outputs` has no meaning for JAX arrays (no strides): accepted,
no effect.

gradcheck reads values, so it runs outside `jax.jit`; the function it checks may be jitted.

The package exports the functions as torch users call them: `jamp.autograd.gradcheck(f,
inputs)`, `from jamp.autograd import gradcheck, gradgradcheck` (docs/autograd.md says why this
module is not named `gradcheck`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_internals as jx
from jamp._checks import ArgumentAssertionError, check_bool, check_positive
from jamp.policy.dtypes import is_inexact

__all__ = ["GradcheckError", "PerturbedOutputError", "gradcheck", "gradgradcheck"]

# One seed: fast mode's random vectors and gradgradcheck's grad_outputs are the same in every
# run, as torch's are (a fresh default-seeded generator each call).
_SEED = 0


class GradcheckError(RuntimeError):
    """gradcheck or gradgradcheck found derivatives that disagree with finite differences, or
    a backward that breaks one of the rules it checks. A RuntimeError, as torch's is."""


class PerturbedOutputError(AssertionError):
    """An output of the function gradcheck checks changed its shape or dtype when an input was
    nudged by `eps`, so finite differences have no meaning there. torch asserts this (an
    `AssertionError`, also with `raise_exception=False`: the function cannot be checked, which
    is not a failed check)."""


def _allclose(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> bool:
    return bool(np.allclose(a, b, rtol=rtol, atol=atol))


def _show(x: np.ndarray) -> str:
    return np.array2string(np.asarray(x), precision=6, threshold=400, max_line_width=100)


def _is_checked(x: Any) -> bool:
    """The inputs that gradcheck differentiates: floating-point and complex arrays."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and is_inexact(x)


def _as_tuple(x: Any) -> tuple:
    if isinstance(x, tuple):
        return x
    return tuple(x) if isinstance(x, list) else (x,)


def _x64_on() -> bool:
    return jax.dtypes.canonicalize_dtype(jnp.float64) == np.dtype(np.float64)


def _substituted(func: Callable, args: Sequence, positions: Sequence[int]) -> Callable:
    """`func` as a function of the arguments at `positions` (the rest of `args` fixed),
    returning all its outputs as a tuple of arrays."""

    def call(*xs) -> tuple:
        full = list(args)
        for i, x in zip(positions, xs):
            full[i] = x
        outs = _as_tuple(func(*full))
        for o in outs:
            if not isinstance(o, (jax.Array, np.ndarray, np.generic)):
                raise TypeError("gradcheck expects func to return an array or a tuple of "
                                f"arrays, but an output has type {type(o)}.")
        return tuple(jnp.asarray(o) for o in outs)

    return call


class _Check:
    """One gradcheck: `func` at `inputs`, its checked inputs and floating-point outputs."""

    def __init__(self, func: Callable, inputs: Any, eps: float, atol: float, rtol: float,
                 nondet_tol: float, check_grad_dtypes: bool, stacklevel: int | None):
        self.eps, self.atol, self.rtol = eps, atol, rtol
        self.nondet_tol, self.check_grad_dtypes = nondet_tol, check_grad_dtypes
        self.numerical_jacobians: dict[int, list[np.ndarray]] = {}
        self.args = list(_as_tuple(inputs))
        if any(jx.is_tracer(a) for a in self.args):
            raise TypeError("gradcheck compares concrete values: call it outside jax.jit, "
                            "jax.vmap and jax.grad (the function it checks may use them).")
        self.positions = [i for i, a in enumerate(self.args) if _is_checked(a)]
        if not self.positions:
            raise ValueError("gradcheck expects at least one floating-point array among the "
                             "inputs (every such input is differentiated), but found none.")
        for i in self.positions:
            self.args[i] = jnp.asarray(self.args[i])
        self.xs = [self.args[i] for i in self.positions]
        self.call = _substituted(func, self.args, self.positions)
        for i, x in zip(self.positions, self.xs):
            if jnp.issubdtype(x.dtype, jnp.complexfloating):
                raise NotImplementedError(_COMPLEX)
            if x.dtype != np.float64 and stacklevel is not None:
                how = ("" if _x64_on() else " JAX computes in float32 unless 64-bit mode is "
                       "on: `jax.config.update('jax_enable_x64', True)` or `with "
                       "jax.enable_x64(True):`.")
                warnings.warn(f"Input #{i} is {x.dtype}, not double precision (float64): "
                              f"finite differences with eps={eps} in this precision will "
                              f"likely make the check fail.{how}", stacklevel=stacklevel)
        outs = self.call(*self.xs)
        self.n_outs = len(outs)
        self.out_positions = [i for i, o in enumerate(outs)
                              if is_inexact(o)]
        self.outs = [outs[i] for i in self.out_positions]
        if any(jnp.issubdtype(o.dtype, jnp.complexfloating) for o in self.outs):
            raise NotImplementedError(_COMPLEX)

    # -- the function and its derivatives --------------------------------------------------

    def floating(self, *xs) -> tuple:
        """`func` of the checked inputs, returning its floating-point outputs."""
        outs = self.call(*xs)
        return tuple(outs[i] for i in self.out_positions)

    @functools.cached_property
    def backward(self) -> Callable:
        """The vjp of the floating outputs at the inputs (from one forward pass)."""
        return jax.vjp(self.floating, *self.xs)[1]

    def cotangents(self, j: int, value: np.ndarray) -> tuple:
        """Zero output gradients, but `value` (flat) for floating output j."""
        return tuple((jnp.asarray(value, o.dtype).reshape(o.shape) if k == j
                      else jnp.zeros_like(o)) for k, o in enumerate(self.outs))

    def tangents(self, p: int, value: np.ndarray) -> tuple:
        return tuple((jnp.asarray(value, x.dtype).reshape(x.shape) if k == p
                      else jnp.zeros_like(x)) for k, x in enumerate(self.xs))

    def numerical_jvp(self, p: int, u: np.ndarray) -> list[np.ndarray]:
        """Central differences of each floating output along `eps * u` (flat) for input p."""
        x = np.asarray(self.xs[p])
        step = (self.eps * u).astype(x.dtype).reshape(x.shape)
        lo, hi = (self.perturbed(p, u, jnp.asarray(x + sign * step), sign) for sign in (-1, 1))
        return [((np.asarray(b) - np.asarray(a)) / (2 * self.eps)).reshape(-1)
                for a, b in zip(lo, hi)]

    def perturbed(self, p: int, u: np.ndarray, x: jax.Array, sign: int) -> tuple:
        """The floating outputs with input p moved to `x` (by `sign * eps * u`), each checked
        to keep its shape and dtype (numpy would broadcast a difference of two shapes)."""
        xs = list(self.xs)
        xs[p] = x
        outs = self.call(*xs)
        if len(outs) != self.n_outs:
            raise PerturbedOutputError(
                f"Expected func to return as many outputs when inputs are perturbed, but it "
                f"returned {self.n_outs} at the inputs and {len(outs)} "
                f"{self.nudge(p, u, sign)}.")
        for j, o in zip(self.out_positions, self.outs):
            if (outs[j].shape, outs[j].dtype) != (o.shape, o.dtype):
                raise PerturbedOutputError(self.changed(j, o, outs[j], p, u, sign))
        return tuple(outs[j] for j in self.out_positions)

    def changed(self, j: int, before: jax.Array, after: jax.Array, p: int, u: np.ndarray,
                sign: int) -> str:
        what, was, now = (("shape", before.shape, after.shape) if before.shape != after.shape
                          else ("dtype", before.dtype, after.dtype))
        return (f"Expected func to return outputs with the same {what} when inputs are "
                f"perturbed, but output {j} has {what} {was} at the inputs but {now} "
                f"{self.nudge(p, u, sign)}. Finite differences need each output to keep its "
                "shape and dtype near the inputs.")

    def nudge(self, p: int, u: np.ndarray, sign: int) -> str:
        """How input p was moved: at one element (slow mode) or along a random vector."""
        nonzero = np.flatnonzero(u)
        if len(nonzero) == 1:
            index = tuple(int(i) for i in np.unravel_index(nonzero[0], self.xs[p].shape))
            where = f"at element {index}"
        else:
            where = "along a random unit vector (fast_mode)"
        return f"with input {self.positions[p]} perturbed {where} by {sign * self.eps}"

    def numerical(self, p: int) -> list[np.ndarray]:
        """Input p's numerical Jacobian with each floating output: (input size, output size).
        Computed once: the backward and the forward checks compare with the same one."""
        if p not in self.numerical_jacobians:
            size = self.xs[p].size
            columns = [self.numerical_jvp(p, np.eye(1, size, k).ravel()) for k in range(size)]
            self.numerical_jacobians[p] = [np.stack([c[j] for c in columns]) if size else
                                           np.zeros((0, o.size)) for j, o in enumerate(self.outs)]
        return self.numerical_jacobians[p]

    def analytical(self, j: int) -> list[np.ndarray]:
        """Output j's Jacobian with each checked input, row by row from the backward, twice:
        (input size, output size) each, torch's layout."""
        pullback = self.backward
        size = self.outs[j].size
        runs = []
        for _ in range(2):
            rows = [self.grads(pullback(self.cotangents(j, np.eye(1, size, k).ravel())))
                    for k in range(size)]
            runs.append([np.stack([r[p] for r in rows], axis=1) if size else
                         np.zeros((x.size, 0)) for p, x in enumerate(self.xs)])
        self.check_reentrant(runs[0], runs[1])
        return runs[0]

    def grads(self, grads: Sequence) -> list[np.ndarray]:
        """The backward's input gradients, flat, after torch's checks of their shape and dtype."""
        flat = []
        for g, x in zip(grads, self.xs):
            if g.shape != x.shape:
                raise GradcheckError("Analytical gradient has incorrect size: "
                                     f"{g.shape}, not the input's {x.shape}.")
            if self.check_grad_dtypes and g.dtype != x.dtype:
                raise GradcheckError(f"Gradient has dtype mismatch: {g.dtype}, not the "
                                     f"input's {x.dtype}.")
            flat.append(np.asarray(g).reshape(-1))
        return flat

    def check_reentrant(self, first: list, second: list) -> None:
        for a, b in zip(first, second):
            if a.size and np.max(np.abs(a - b)) > self.nondet_tol:
                raise GradcheckError(
                    "Backward is not reentrant: running it twice with the same input and "
                    "output gradients gave different values. The tolerance for nondeterminism "
                    f"was {self.nondet_tol} (nondet_tol).")

    def forward(self, p: int) -> list[np.ndarray]:
        """Input p's Jacobian with each floating output, column by column from `jax.jvp`."""
        size = self.xs[p].size
        columns = []
        for k in range(size):
            _, tangents = jax.jvp(self.floating, tuple(self.xs),
                                  self.tangents(p, np.eye(1, size, k).ravel()))
            columns.append([np.asarray(t).reshape(-1) for t in tangents])
        return [np.stack([c[j] for c in columns]) if size else np.zeros((0, o.size))
                for j, o in enumerate(self.outs)]

    # -- the checks -------------------------------------------------------------------------

    def mismatch(self, j: int, p: int, numerical, analytical, forward: bool) -> str:
        mode = "computed with forward mode " if forward else ""
        return (f"Jacobian {mode}mismatch for output {self.out_positions[j]} with respect to "
                f"input {self.positions[p]},\nnumerical:{_show(numerical)}\n"
                f"analytical:{_show(analytical)}\n")

    def slow(self, forward: bool) -> None:
        numerical = [self.numerical(p) for p in range(len(self.xs))]
        if forward:
            analytical = [self.forward(p) for p in range(len(self.xs))]
        else:
            by_output = [self.analytical(j) for j in range(len(self.outs))]
            analytical = [[by_output[j][p] for j in range(len(self.outs))]
                          for p in range(len(self.xs))]
        for j in range(len(self.outs)):
            for p in range(len(self.xs)):
                a, n = analytical[p][j], numerical[p][j]
                if not _allclose(a, n, self.rtol, self.atol):
                    raise GradcheckError(self.mismatch(j, p, n, a, forward))

    def fast(self, forward: bool) -> None:
        rng = np.random.default_rng(_SEED)
        us = [_unit(rng, x.size) for x in self.xs]
        vs = [_unit(rng, o.size) for o in self.outs]
        numerical = [self.numerical_jvp(p, u) for p, u in enumerate(us)]  # [p][j]: J u
        if forward:
            for p, u in enumerate(us):
                _, tangents = jax.jvp(self.floating, tuple(self.xs), self.tangents(p, u))
                for j, t in enumerate(tangents):
                    a, n = np.asarray(t).reshape(-1), numerical[p][j]
                    if not _allclose(a, n, self.rtol, self.atol * u.sum()):
                        self.fast_failed(j, p, n, a, forward)
            return
        pullback = self.backward
        for j, v in enumerate(vs):
            runs = [self.grads(pullback(self.cotangents(j, v))) for _ in range(2)]
            self.check_reentrant(runs[0], runs[1])
            for p, u in enumerate(us):
                a = np.dot(runs[0][p], u)
                n = np.dot(v, numerical[p][j])
                if not _allclose(a, n, self.rtol, self.atol * u.sum() * v.sum()):
                    self.fast_failed(j, p, n, a, forward)

    def fast_failed(self, j: int, p: int, numerical, analytical, forward: bool) -> None:
        full_numerical = self.numerical(p)[j]
        full_analytical = self.forward(p)[j] if forward else self.analytical(j)[p]
        passes_slow = _allclose(full_analytical, full_numerical, self.rtol, self.atol)
        diff = np.max(np.abs(full_numerical - full_analytical)) if full_numerical.size else 0.0
        message = (
            self.mismatch(j, p, numerical, analytical, forward)
            + "\nThe numbers above are the Jacobian projected on random unit vectors "
              "(fast_mode=True). The full Jacobians of that output and input, as "
              f"fast_mode=False compares them:\n\nNumerical:\n{_show(full_numerical)}\n"
              f"Analytical:\n{_show(full_analytical)}\n\n"
              f"The largest elementwise difference is {diff}.\n")
        if passes_slow:
            message += ("\nThe elementwise differences are within tolerance: the check would "
                        "pass with fast_mode=False, which is the mode to use for this function.")
        raise GradcheckError(message)

    def zero_output_grads(self) -> None:
        """Zero output gradients give zero input gradients (torch: the backward is multiplied
        by the output gradient), each of its input's dtype."""
        grads = self.backward(tuple(jnp.zeros_like(o) for o in self.outs))
        for p, (g, x) in enumerate(zip(self.grads(grads), self.xs)):
            if np.any(g != 0):
                raise GradcheckError("backward not multiplied by grad_output: zero output "
                                     "gradients gave nonzero gradients for input "
                                     f"{self.positions[p]}.")
            if grads[p].dtype != x.dtype:
                raise GradcheckError(f"grad is incorrect type: {grads[p].dtype} for input "
                                     f"{self.positions[p]} of dtype {x.dtype}.")

    def undefined_grads(self) -> None:
        """With several outputs, the backward works when one of them is unused (its gradient
        a symbolic zero, torch's undefined grad) and gives zero for zero gradients."""
        if len(self.outs) < 2:
            return
        for skipped in range(len(self.outs)):
            kept = [k for k in range(len(self.outs)) if k != skipped]

            def partial(*xs, kept=kept):
                outs = self.floating(*xs)
                return tuple(outs[k] for k in kept)

            try:
                _, pullback = jax.vjp(partial, *self.xs)
                grads = pullback(tuple(jnp.zeros_like(self.outs[k]) for k in kept))
            except Exception as error:  # what the backward raised, reported as torch does
                raise GradcheckError(
                    "Expected the backward to handle an undefined output gradient: with output "
                    f"{self.out_positions[skipped]} unused (a symbolic zero gradient), it "
                    f"raised {type(error).__name__}: {error}") from error
            if any(np.any(np.asarray(g) != 0) for g in grads):
                raise GradcheckError(
                    "Expected all input gradients to be zero when all output gradients are "
                    f"undefined or zero (output {self.out_positions[skipped]} unused, the others "
                    "zero), but some are not.")

    def batched_backward(self) -> None:
        rng = np.random.default_rng(_SEED)
        pullback = self.backward
        for j, o in enumerate(self.outs):
            cts = rng.standard_normal((2, o.size))
            expected = [np.stack(g) for g in zip(*(self.grads(pullback(self.cotangents(j, c)))
                                                   for c in cts))]
            try:
                batched = jax.vmap(lambda c, j=j: pullback(self.cotangents(j, c)))(
                    jnp.asarray(cts, o.dtype))
            except Exception as error:
                raise GradcheckError(_batched_error("backward", error)) from error
            self.compare_batched(j, batched, expected, forward=False)

    def batched_forward(self) -> None:
        rng = np.random.default_rng(_SEED)
        for p, x in enumerate(self.xs):
            ts = rng.standard_normal((2, x.size))

            def jvp(t, p=p):
                return jax.jvp(self.floating, tuple(self.xs), self.tangents(p, t))[1]

            expected = [np.stack([np.asarray(t).reshape(-1) for t in column])
                        for column in zip(*(jvp(t) for t in ts))]
            try:
                batched = jax.vmap(jvp)(jnp.asarray(ts, x.dtype))
            except Exception as error:
                raise GradcheckError(_batched_error("forward", error)) from error
            self.compare_batched(p, batched, expected, forward=True)

    def compare_batched(self, k: int, batched: Sequence, expected: list, forward: bool) -> None:
        for m, (got, want) in enumerate(zip(batched, expected)):
            got = np.asarray(got).reshape(want.shape)
            if not _allclose(got, want, 1e-5, 1e-8):  # torch.allclose's defaults
                j, p = (m, k) if forward else (k, m)
                mode = "forward" if forward else "backward"
                raise GradcheckError(
                    f"For output {self.out_positions[j]} and input {self.positions[p]}: the "
                    f"{mode} batched with jax.vmap differs from the {mode} run one vector at "
                    f"a time.\n\nGot:\n{_show(got)}\n\nExpected:\n{_show(want)}")


_COMPLEX = ("gradcheck of complex inputs or outputs is not supported: JAX's gradients of "
            "complex functions are the conjugates of torch's. Check the real and imaginary "
            "parts as real functions of real inputs.")


def _unit(rng: np.random.Generator, size: int) -> np.ndarray:
    """torch's fast-mode vector: uniform in [0, 1), scaled to unit length."""
    u = rng.random(size)
    norm = np.linalg.norm(u)
    return u / norm if norm else u


def _batched_error(mode: str, error: Exception) -> str:
    return (f"While computing batched gradients ({mode} under jax.vmap), got "
            f"{type(error).__name__}: {error}\n\nA custom rule must be written with operations "
            "that jax.vmap can batch (no Python control flow on values, no host callbacks "
            "without a batching rule). Or pass check_batched_grad=False "
            "(check_batched_forward_grad=False).")


def _check_options(eps, atol, rtol, nondet_tol, **flags) -> None:
    check_positive("eps", eps)
    check_positive("atol", atol, allow_zero=True)
    check_positive("rtol", rtol, allow_zero=True)
    check_positive("nondet_tol", nondet_tol, allow_zero=True)
    for name, value in flags.items():
        check_bool(name, value)


def gradcheck(
    func: Callable[..., Any],
    inputs: Any,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    raise_exception: bool = True,
    nondet_tol: float = 0.0,
    check_undefined_grad: bool = True,
    check_grad_dtypes: bool = False,
    check_batched_grad: bool = False,
    check_batched_forward_grad: bool = False,
    check_forward_ad: bool = False,
    check_backward_ad: bool = True,
    fast_mode: bool = False,
    masked: bool | None = None,
) -> bool:
    """Checks JAX's derivatives of `func` at `inputs` against finite differences (torch's
    `torch.autograd.gradcheck`, same keywords and defaults).

    The defaults are tuned for float64: enable JAX's 64-bit mode (`jax.enable_x64(True)`) and
    pass float64 inputs, or expect a warning and, likely, a failure.

    Args:
      func: takes `inputs` and returns an array or a tuple of arrays.
      inputs: an array or a tuple of inputs; floating-point arrays among them are checked.
      eps: the finite-difference step.
      atol: absolute tolerance.
      rtol: relative tolerance.
      raise_exception: raise `GradcheckError` on a failed check (False: return False).
      nondet_tol: how far two runs of the same backward may differ.
      check_undefined_grad: check that the backward handles an unused output (a symbolic zero
        gradient) when `func` has several outputs.
      check_grad_dtypes: check that gradients have their inputs' dtypes.
      check_batched_grad: check `jax.vmap` of the backward.
      check_batched_forward_grad: check `jax.vmap` of the forward mode (needs
        `check_forward_ad`).
      check_forward_ad: check the Jacobian from `jax.jvp` too.
      check_backward_ad: check the Jacobian from `jax.vjp` (the backward).
      fast_mode: compare random projections of the Jacobians instead of the full ones.
      masked: accepted for torch's code (sparse layouts); no effect.

    Returns:
      True when every check passes; False when one fails and `raise_exception` is False.

    Raises:
      GradcheckError: a check failed; the message names the output and input and shows both
        Jacobians.

    >>> import jax, jax.numpy as jnp
    >>> from jamp.autograd import gradcheck
    >>> with jax.enable_x64(True):
    ...     gradcheck(jnp.sin, jnp.array([0.5, 1.0], jnp.float64))
    True
    """
    _check_options(eps, atol, rtol, nondet_tol, raise_exception=raise_exception,
                   check_undefined_grad=check_undefined_grad,
                   check_grad_dtypes=check_grad_dtypes, check_batched_grad=check_batched_grad,
                   check_batched_forward_grad=check_batched_forward_grad,
                   check_forward_ad=check_forward_ad, check_backward_ad=check_backward_ad,
                   fast_mode=fast_mode)
    if masked is not None:
        check_bool("masked", masked)
    if not (check_forward_ad or check_backward_ad):
        raise ArgumentAssertionError("Expected at least one of check_forward_ad or "
                                     "check_backward_ad to be True.")
    if check_batched_grad and not check_backward_ad:
        raise ArgumentAssertionError("check_batched_grad=True needs check_backward_ad=True.")
    if check_batched_forward_grad and not check_forward_ad:
        raise ArgumentAssertionError("check_batched_forward_grad=True needs "
                                     "check_forward_ad=True.")
    return _gradcheck(func, inputs, eps, atol, rtol, raise_exception, nondet_tol,
                      check_undefined_grad, check_grad_dtypes, check_batched_grad,
                      check_batched_forward_grad, check_forward_ad, check_backward_ad, fast_mode)


def _gradcheck(func, inputs, eps, atol, rtol, raise_exception, nondet_tol, check_undefined_grad,
               check_grad_dtypes, check_batched_grad, check_batched_forward_grad,
               check_forward_ad, check_backward_ad, fast_mode) -> bool:
    # Warnings name the line that called gradcheck or gradgradcheck: four frames up.
    check = _Check(func, inputs, eps, atol, rtol, nondet_tol, check_grad_dtypes, stacklevel=4)
    try:
        mode = check.fast if fast_mode else check.slow
        if check_backward_ad:
            mode(forward=False)
        if check_forward_ad:
            mode(forward=True)
        if check_batched_forward_grad:
            check.batched_forward()
        if check_backward_ad:
            if check_batched_grad:
                check.batched_backward()
            check.zero_output_grads()
            if check_undefined_grad:
                check.undefined_grads()
    except GradcheckError:
        if raise_exception:
            raise
        return False
    return True


def gradgradcheck(
    func: Callable[..., Any],
    inputs: Any,
    grad_outputs: Any = None,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    gen_non_contig_grad_outputs: bool = False,
    raise_exception: bool = True,
    nondet_tol: float = 0.0,
    check_undefined_grad: bool = True,
    check_grad_dtypes: bool = False,
    check_batched_grad: bool = False,
    check_fwd_over_rev: bool = False,
    check_rev_over_rev: bool = True,
    fast_mode: bool = False,
    masked: bool = False,
) -> bool:
    """Checks second derivatives of `func` (torch's `torch.autograd.gradgradcheck`): runs
    `gradcheck` on the function `(inputs, grad_outputs) -> vjp of func at inputs with
    grad_outputs`, so the backward's own derivatives (reverse over reverse, and forward over
    reverse with `check_fwd_over_rev`) are checked against finite differences.

    Args:
      func: takes `inputs` and returns an array or a tuple of arrays.
      inputs: an array or a tuple of inputs; floating-point arrays among them are checked.
      grad_outputs: gradients for `func`'s floating-point outputs (an array or a tuple); by
        default random, uniform in [-1, 1), from a fixed seed.
      eps, atol, rtol, raise_exception, nondet_tol, check_undefined_grad, check_grad_dtypes,
        check_batched_grad, fast_mode, masked: as for `gradcheck`.
      gen_non_contig_grad_outputs: accepted for torch's code; JAX arrays have no strides.
      check_fwd_over_rev: check forward-mode derivatives of the backward.
      check_rev_over_rev: check reverse-mode derivatives of the backward.

    Returns:
      True when every check passes; False when one fails and `raise_exception` is False.

    >>> import jax, jax.numpy as jnp
    >>> from jamp.autograd import gradgradcheck
    >>> with jax.enable_x64(True):
    ...     gradgradcheck(lambda x: x ** 3, jnp.array([0.5, 1.0], jnp.float64))
    True
    """
    for name, value in dict(gen_non_contig_grad_outputs=gen_non_contig_grad_outputs,
                            check_fwd_over_rev=check_fwd_over_rev,
                            check_rev_over_rev=check_rev_over_rev,
                            check_undefined_grad=check_undefined_grad,
                            check_batched_grad=check_batched_grad).items():
        check_bool(name, value)
    if not (check_fwd_over_rev or check_rev_over_rev):
        raise ArgumentAssertionError("Expected at least one of check_fwd_over_rev or "
                                     "check_rev_over_rev to be True.")
    if check_undefined_grad and not check_rev_over_rev:
        raise ArgumentAssertionError("check_undefined_grad=True needs check_rev_over_rev=True.")
    if check_batched_grad and not check_rev_over_rev:
        raise ArgumentAssertionError("check_batched_grad=True needs check_rev_over_rev=True.")
    _check_options(eps, atol, rtol, nondet_tol, raise_exception=raise_exception,
                   check_grad_dtypes=check_grad_dtypes, fast_mode=fast_mode, masked=masked)
    base = _Check(func, inputs, eps, atol, rtol, nondet_tol, check_grad_dtypes, stacklevel=None)
    if grad_outputs is None:
        rng = np.random.default_rng(_SEED)
        grad_outputs = tuple(jnp.asarray(rng.uniform(-1.0, 1.0, o.shape), o.dtype)
                             for o in base.outs)
    grad_outputs = tuple(jnp.asarray(g) for g in _as_tuple(grad_outputs))
    if len(grad_outputs) != len(base.outs):
        raise ValueError(f"grad_outputs must hold one array per floating-point output of "
                         f"func ({len(base.outs)}), got {len(grad_outputs)}.")
    for k, (g, o) in enumerate(zip(grad_outputs, base.outs)):
        if g.shape != o.shape:
            raise ValueError(f"grad_outputs[{k}] has shape {g.shape}, but output "
                             f"{base.out_positions[k]} of func has shape {o.shape}.")
    n_args = len(base.args)

    def backward(*args):
        """The vjp of func's floating outputs at `args[:n_args]`, with `args[n_args:]` as
        the output gradients."""
        call = _substituted(func, args[:n_args], base.positions)
        _, pullback = jax.vjp(lambda *xs: tuple(call(*xs)[i] for i in base.out_positions),
                              *(args[i] for i in base.positions))
        return pullback(tuple(g.astype(o.dtype) for g, o in zip(args[n_args:], base.outs)))

    return _gradcheck(backward, tuple(base.args) + grad_outputs, eps, atol, rtol,
                      raise_exception, nondet_tol, check_undefined_grad, check_grad_dtypes,
                      check_batched_grad, False, check_fwd_over_rev, check_rev_over_rev,
                      fast_mode)


__all__ = ["GradcheckError", "PerturbedOutputError", "gradcheck", "gradgradcheck"]
