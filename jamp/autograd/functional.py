"""torch.autograd.functional on JAX: `jacobian`, `hessian`, `vjp`, `jvp`, `hvp` and `vhp` with
torch's signatures, return structures, rules for `v` and errors, built on `jax.vjp`, `jax.jvp`,
`jax.jacrev`, `jax.jacfwd` and `jax.grad`.

Structures follow torch's. `inputs` is an array or a tuple of arrays and `func` returns an array
or a tuple of arrays; a result is a single array where torch's is a single Tensor and a tuple
where torch's is one: `jacobian` of a function with several outputs and several inputs is a
tuple over outputs of tuples over inputs, `hessian` of several inputs a tuple of tuples over
inputs, and `vjp`, `jvp`, `hvp`, `vhp` return `(func_output, result)`.

Two of torch's flags mean nothing new in JAX and are accepted for portability: `create_graph`
(every result here is differentiable again, with `jax.grad` or any other transform, whatever
the flag) and `vectorize` (JAX's Jacobians are always computed with `jax.vmap`). torch's rules
about which options go together are kept, so a call fails here exactly where it fails in torch.

`strict=True` raises where an output does not depend on an input, as torch does; dependence is
read from the traced program (`jamp.autograd.dependence`), so the answer is the same eagerly
and under `jax.jit`.

Every function works under `jax.jit`, `jax.vmap` and `jax.grad`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jamp._checks import ArgumentAssertionError, check_bool
from jamp.autograd.dependence import contains, dependence
from jamp.policy.dtypes import is_inexact

__all__ = ["hessian", "hvp", "jacobian", "jvp", "vhp", "vjp"]

Arrays = Union[jax.Array, tuple[jax.Array, ...]]

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)
_OUTPUTS = "outputs of the user-provided function"
_STRATEGIES = ("forward-mode", "reverse-mode")


# -- inputs, outputs and v -----------------------------------------------------------------------

def _as_tuple(value: Any, what: str, fn_name: str) -> tuple[bool, tuple[jax.Array, ...]]:
    """(whether `value` was a tuple, its arrays as a tuple); TypeError naming anything else."""
    is_tuple = isinstance(value, tuple)
    values = value if is_tuple else (value,)
    for i, element in enumerate(values):
        if not isinstance(element, _ARRAY_TYPES):
            which = f"the value at index {i}" if is_tuple else f"the given {what}"
            raise TypeError(f"The {what} given to {fn_name} must be either an array or a tuple "
                            f"of arrays, but {which} has type {type(element)}.")
    return is_tuple, tuple(jnp.asarray(v) for v in values)


def _inputs(inputs: Any, fn_name: str) -> tuple[bool, tuple[jax.Array, ...]]:
    is_tuple, xs = _as_tuple(inputs, "inputs", fn_name)
    for i, x in enumerate(xs):
        if not is_inexact(x):
            raise TypeError(f"Input {i} given to {fn_name} has dtype {x.dtype}: only floating-"
                            "point and complex inputs can be differentiated (torch's "
                            "requires_grad rule).")
    return is_tuple, xs


class _Tupled:
    """`func` as a function returning a tuple of arrays; records whether it returned a tuple."""

    def __init__(self, func: Callable, fn_name: str):
        self.func, self.fn_name, self.is_tuple = func, fn_name, False

    def __call__(self, *xs):
        self.is_tuple, outs = _as_tuple(self.func(*xs), _OUTPUTS, self.fn_name)
        return outs


def _single_output(func: Callable, fn_name: str) -> Callable:
    """`func`, checked to return one array of one element (what hvp, vhp and hessian take)."""

    def single(*xs):
        is_tuple, outs = _as_tuple(func(*xs), _OUTPUTS, fn_name)
        if is_tuple:
            raise RuntimeError(f"The function given to {fn_name} should return a single array, "
                               f"not a tuple of {len(outs)}.")
        (out,) = outs
        if out.size != 1:
            raise RuntimeError(f"The array returned by the function given to {fn_name} should "
                               f"contain a single element, but it has shape {out.shape}.")
        return out

    return single


def _v(v: Any, like: tuple[jax.Array, ...], is_like_tuple: bool, fn_name: str,
       none_rule: str) -> tuple[jax.Array, ...]:
    """`v` checked against the arrays it pairs with and cast to their dtypes; ones when `v` is
    None, which torch allows only for a single array of a single element. For an integer
    output, which carries no gradient (torch ignores its v), JAX's float0 zeros."""
    if v is None:
        if len(like) != 1 or like[0].size != 1:
            raise RuntimeError(f"The vector v can only be None if {none_rule} a single array "
                               "with a single element.")
        return (_cast(jnp.ones(like[0].shape), like[0]),)
    _, vs = _as_tuple(v, "v", fn_name)
    if len(vs) != len(like):
        if is_like_tuple:
            raise RuntimeError(f"v is a tuple of invalid length: should be {len(like)} but got "
                               f"{len(vs)}.")
        raise RuntimeError("The given v should contain a single array.")
    for i, (el, ref) in enumerate(zip(vs, like)):
        if el.shape != ref.shape:
            entry = f"Entry {i} in " if is_like_tuple else ""
            raise RuntimeError(f"{entry}v has invalid size: should be {ref.shape} but got "
                               f"{el.shape}.")
    return tuple(_cast(el, ref) for el, ref in zip(vs, like))


def _cast(v: jax.Array, like: jax.Array):
    if is_inexact(like):
        return v.astype(like.dtype)
    return np.zeros(like.shape, jax.dtypes.float0)


def _unpack(res: tuple, is_tuple: bool):
    return res if is_tuple else res[0]


def _unpack2(res: tuple, is_outer_tuple: bool, is_inner_tuple: bool):
    return _unpack(tuple(_unpack(row, is_inner_tuple) for row in res), is_outer_tuple)


def _materialized(tangents: Sequence, like: Sequence[jax.Array]) -> tuple:
    """Tangents with JAX's float0 (of integer outputs) as zeros of the output's dtype, as torch
    fills in zeros."""
    return tuple(jnp.zeros(ref.shape, ref.dtype) if t.dtype == jax.dtypes.float0 else t
                 for t, ref in zip(tangents, like))


# -- options -------------------------------------------------------------------------------------

def _flags(**flags: Any) -> None:
    for name, value in flags.items():
        check_bool(name, value)


def _check_strategy(keyword: str, strategy: Any) -> None:
    if not (isinstance(strategy, str) and strategy in _STRATEGIES):
        raise ArgumentAssertionError(
            f'{keyword} must be "forward-mode" or "reverse-mode", got {keyword}={strategy!r}. '
            '"forward-mode" (jax.jacfwd) tends to be faster for functions with more outputs '
            'than inputs, "reverse-mode" (jax.jacrev) otherwise.')


def _check_jacobian_options(fn_name: str, keyword: str, strategy: str, create_graph: bool,
                            strict: bool, vectorize: bool) -> None:
    """torch's rules on which options go together, with torch's exception types."""
    where = f"jamp.autograd.functional.{fn_name}"
    if strategy == "forward-mode":
        if create_graph:
            raise NotImplementedError(
                f'{where}: `create_graph=True` and `{keyword}="forward-mode"` do not go '
                "together (torch refuses the pair too). Set `create_graph=False` (results are "
                f'differentiable again anyway) or `{keyword}="reverse-mode"`.')
        if strict:
            raise RuntimeError(
                f'{where}: `strict=True` and `{keyword}="forward-mode"` do not go together '
                f'(torch refuses the pair too). Set `strict=False` or `{keyword}="reverse-mode"`.')
        if not vectorize:
            raise NotImplementedError(
                f'{where}: `{keyword}="forward-mode"` needs `vectorize=True`, as in torch. '
                "Pass `vectorize=True`: JAX vectorizes with vmap either way.")
    elif strict and vectorize:
        raise RuntimeError(
            f"{where}: `strict=True` and `vectorize=True` do not go together (torch refuses "
            "the pair too). Set `strict=False` or `vectorize=False`.")


# -- strict mode ---------------------------------------------------------------------------------

def _require_outputs_depend(deps) -> None:
    for i, row in enumerate(deps):
        if not any(row):
            raise RuntimeError(
                f"Output {i} of the user-provided function does not require gradients: it "
                "depends on none of the inputs (a constant, a `lax.stop_gradient`ed value, or "
                "one computed through integers or booleans). The outputs must be computed in a "
                "differentiable manner from the inputs when running in strict mode.")


def _require_inputs_used(deps, n_inputs: int) -> None:
    for j in range(n_inputs):
        if not any(row[j] for row in deps):
            raise RuntimeError(f"The output of the user-provided function is independent of "
                               f"input {j}. This is not allowed in strict mode.")


def _require_depends_when_create_graph(deps, what: Callable[[int], str]) -> None:
    for i, row in enumerate(deps):
        if not any(row):
            raise RuntimeError(f"{what(i)} is independent of the inputs. This is not allowed "
                               "in strict mode when create_graph=True.")


def _check_second_order(single: Callable, grad_fn: Callable, xs: tuple, *, hessian: bool,
                        vhp: bool) -> None:
    """Strict mode for hessian, hvp and vhp: torch's checks on the output and on the gradient."""
    deps = dependence(lambda *ys: (single(*ys),), xs)
    _require_outputs_depend(deps)
    if not hessian:
        _require_inputs_used(deps, len(xs))
    grad_deps = dependence(grad_fn, xs)
    for i, row in enumerate(grad_deps):
        if not any(row):
            raise RuntimeError(
                "While computing the hessian, found that the jacobian of the user-provided "
                f"function with respect to input {i} is independent of the input. This is not "
                "allowed in strict mode. You should ensure that your function is twice "
                "differentiable and that the jacobian depends on the inputs (this would be "
                "violated by a linear function for example).")
    if hessian:  # torch's outer jacobian runs in strict mode too
        for i, row in enumerate(grad_deps):
            for j, depends in enumerate(row):
                if not depends:
                    raise RuntimeError(
                        "The jacobian of the user-provided function with respect to input "
                        f"{i} is independent of input {j}. This is not allowed in strict "
                        "mode.")
    if vhp:
        for j in range(len(xs)):
            if not any(row[j] for row in grad_deps):
                raise RuntimeError("The jacobian of the user-provided function is independent "
                                   f"of input {j}. This is not allowed in strict mode.")


# -- the API -------------------------------------------------------------------------------------

def vjp(func: Callable[..., Arrays], inputs: Arrays, v: Arrays | None = None,
        create_graph: bool = False, strict: bool = False) -> tuple[Arrays, Arrays]:
    """The vector-Jacobian product `v^T J` of `func` at `inputs` (torch's
    `torch.autograd.functional.vjp`), on `jax.vjp`.

    Args:
      func: takes the arrays of `inputs` and returns an array or a tuple of arrays.
      inputs: an array or a tuple of arrays.
      v: shaped like `func`'s output (an array, or a tuple for a tuple output). May be None
        only when `func` returns a single array of a single element (then ones).
      create_graph: accepted for torch's code: results are always differentiable in JAX. With
        `strict`, raises where the product does not depend on the inputs (a linear `func`), as
        torch does.
      strict: raise a RuntimeError when an output depends on no input, or an input reaches
        no output.

    Returns:
      `(func_output, vjp)`: `func`'s output as it returned it, and `v^T J` shaped like `inputs`.

    >>> import jax.numpy as jnp
    >>> from jamp.autograd.functional import vjp
    >>> out, grad = vjp(lambda x: (x ** 2).sum(), jnp.array([1.0, 2.0]))
    >>> grad
    Array([2., 4.], dtype=float32)
    """
    _flags(create_graph=create_graph, strict=strict)
    is_inputs_tuple, xs = _inputs(inputs, "vjp")
    flat = _Tupled(func, "vjp")
    if strict:
        deps = dependence(flat, xs)
        _require_outputs_depend(deps)
    outs, pullback = jax.vjp(flat, *xs)
    vs = _v(v, outs, flat.is_tuple, "vjp", "the user-provided function returns")
    if strict:
        _require_inputs_used(deps, len(xs))
        if create_graph:
            _require_depends_when_create_graph(
                dependence(lambda *ys: jax.vjp(flat, *ys)[1](vs), xs),
                lambda j: f"The jacobian of the user-provided function with respect to input {j}")
    return _unpack(outs, flat.is_tuple), _unpack(pullback(vs), is_inputs_tuple)


def _jvp(flat: Callable, xs: tuple, vs: tuple) -> tuple[tuple, tuple]:
    """`jax.jvp`; for a function with a custom_vjp inside (a `jamp.autograd.Function` or a
    `jax.custom_vjp` with no forward rule), the transpose of its vjp instead: torch computes
    jvp from double backward, so torch's jvp works on such functions too."""
    # Decided from the program: under jit, jax.jvp of a custom_vjp fails only when lowered.
    if not contains(flat, xs, "custom_vjp_call"):
        outs, tangents = jax.jvp(flat, xs, vs)
        return outs, _materialized(tangents, outs)
    outs, pullback = jax.vjp(flat, *xs)
    _, transpose = jax.vjp(pullback, tuple(_cast(jnp.zeros(o.shape), o) for o in outs))
    (tangents,) = transpose(vs)
    return outs, _materialized(tangents, outs)


def jvp(func: Callable[..., Arrays], inputs: Arrays, v: Arrays | None = None,
        create_graph: bool = False, strict: bool = False) -> tuple[Arrays, Arrays]:
    """The Jacobian-vector product `J v` of `func` at `inputs` (torch's
    `torch.autograd.functional.jvp`), on `jax.jvp`.

    A function holding a `jax.custom_vjp` (such as a `jamp.autograd.Function` without a forward
    rule), which `jax.jvp` refuses, gets the transpose of its vjp instead: torch's own method.

    Args:
      func: takes the arrays of `inputs` and returns an array or a tuple of arrays.
      inputs: an array or a tuple of arrays.
      v: shaped like `inputs`. May be None only when `inputs` is a single array of a single
        element (then ones).
      create_graph: accepted for torch's code: results are always differentiable in JAX. With
        `strict`, raises where the product does not depend on the inputs.
      strict: raise a RuntimeError when an output depends on no input, or an input reaches
        no output.

    Returns:
      `(func_output, jvp)`: `func`'s output, and `J v` shaped like it.

    >>> import jax.numpy as jnp
    >>> from jamp.autograd.functional import jvp
    >>> out, tangent = jvp(lambda x: x ** 2, jnp.array([1.0, 2.0]), jnp.array([1.0, 1.0]))
    >>> tangent
    Array([2., 4.], dtype=float32)
    """
    _flags(create_graph=create_graph, strict=strict)
    is_inputs_tuple, xs = _inputs(inputs, "jvp")
    vs = _v(v, xs, is_inputs_tuple, "jvp", "the input to the user-provided function is")
    flat = _Tupled(func, "jvp")
    if strict:
        deps = dependence(flat, xs)
        _require_outputs_depend(deps)
        _require_inputs_used(deps, len(xs))
    outs, tangents = _jvp(flat, xs, vs)
    if strict and create_graph:
        _require_depends_when_create_graph(
            dependence(lambda *ys: _jvp(flat, ys, vs)[1], xs),
            lambda i: f"The jacobian-vector product for output {i} of the user-provided function")
    return _unpack(outs, flat.is_tuple), _unpack(tangents, flat.is_tuple)


def jacobian(func: Callable[..., Arrays], inputs: Arrays, create_graph: bool = False,
             strict: bool = False, vectorize: bool = False,
             strategy: str = "reverse-mode") -> Any:
    """The Jacobian of `func` at `inputs` (torch's `torch.autograd.functional.jacobian`), on
    `jax.jacrev` or, with `strategy="forward-mode"`, `jax.jacfwd`.

    Args:
      func: takes the arrays of `inputs` and returns an array or a tuple of arrays.
      inputs: an array or a tuple of arrays.
      create_graph: accepted for torch's code: the Jacobian is always differentiable in JAX.
        With `strict`, raises where a block does not depend on the inputs (a linear `func`).
      strict: raise a RuntimeError when an output does not depend on an input. As in torch,
        not together with `vectorize=True` or forward mode.
      vectorize: accepted for torch's code: JAX always vectorizes with vmap. torch's forward
        mode requires it, and so does this one.
      strategy: "reverse-mode" or "forward-mode" (faster with more outputs than inputs).

    Returns:
      For output i and input j, an array of shape `output_i.shape + input_j.shape`: one array
      for a single output and input, a tuple over the inputs or the outputs where only one of
      them is a tuple, and a tuple over outputs of tuples over inputs where both are.

    >>> import jax.numpy as jnp
    >>> from jamp.autograd.functional import jacobian
    >>> jacobian(lambda x, y: x * y, (jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])))[1]
    Array([[1., 0.],
           [0., 2.]], dtype=float32)
    """
    _check_strategy("strategy", strategy)
    _flags(create_graph=create_graph, strict=strict, vectorize=vectorize)
    _check_jacobian_options("jacobian", "strategy", strategy, create_graph, strict, vectorize)
    is_inputs_tuple, xs = _inputs(inputs, "jacobian")
    flat = _Tupled(func, "jacobian")
    if strict:
        deps = dependence(flat, xs)
        _require_outputs_depend(deps)
        for i, row in enumerate(deps):
            for j, depends in enumerate(row):
                if not depends:
                    raise RuntimeError(f"Output {i} of the user-provided function is "
                                       f"independent of input {j}. This is not allowed in "
                                       "strict mode.")
    transform = jax.jacfwd if strategy == "forward-mode" else jax.jacrev
    jac_fn = transform(flat, argnums=tuple(range(len(xs))))
    jac = jac_fn(*xs)
    if strict and create_graph:
        blocks = [(i, j) for i in range(len(jac)) for j in range(len(xs))]
        _require_depends_when_create_graph(
            dependence(lambda *ys: tuple(b for row in jac_fn(*ys) for b in row), xs),
            lambda k: (f"The jacobian of output {blocks[k][0]} of the user-provided function "
                       f"with respect to input {blocks[k][1]}"))
    return _unpack2(jac, flat.is_tuple, is_inputs_tuple)


def _scalar(single: Callable) -> Callable:
    """`single`'s one element as a scalar, and its output as it returned it (an aux)."""

    def scalar(*xs):
        out = single(*xs)
        return out.reshape(()), out

    return scalar


def hessian(func: Callable[..., jax.Array], inputs: Arrays, create_graph: bool = False,
            strict: bool = False, vectorize: bool = False,
            outer_jacobian_strategy: str = "reverse-mode") -> Any:
    """The Hessian of a scalar `func` at `inputs` (torch's `torch.autograd.functional.hessian`):
    the Jacobian of `jax.grad(func)`, reverse mode by default (`jax.jacrev`), or forward over
    reverse (`jax.jacfwd`) with `outer_jacobian_strategy="forward-mode"`.

    Args:
      func: takes the arrays of `inputs` and returns a single array of a single element.
      inputs: an array or a tuple of arrays.
      create_graph: accepted for torch's code: the Hessian is always differentiable in JAX.
      strict: raise a RuntimeError when the output or its gradient does not depend on an input
        (torch's rule: a gradient block that is independent of an input is an error too).
      vectorize: accepted for torch's code: JAX always vectorizes with vmap. Forward mode
        requires it, as in torch.
      outer_jacobian_strategy: "reverse-mode" or "forward-mode".

    Returns:
      For inputs i and j, an array of shape `input_i.shape + input_j.shape`: one array for a
      single input, a tuple of tuples for a tuple of inputs.

    >>> import jax.numpy as jnp
    >>> from jamp.autograd.functional import hessian
    >>> hessian(lambda x: (x ** 3).sum(), jnp.array([1.0, 2.0]))
    Array([[ 6.,  0.],
           [ 0., 12.]], dtype=float32)
    """
    _check_strategy("outer_jacobian_strategy", outer_jacobian_strategy)
    _flags(create_graph=create_graph, strict=strict, vectorize=vectorize)
    _check_jacobian_options("hessian", "outer_jacobian_strategy", outer_jacobian_strategy,
                            create_graph, strict, vectorize)
    is_inputs_tuple, xs = _inputs(inputs, "hessian")
    single = _single_output(func, "hessian")
    argnums = tuple(range(len(xs)))
    grad_fn = jax.grad(lambda *ys: single(*ys).reshape(()), argnums=argnums)
    if strict:
        _check_second_order(single, grad_fn, xs, hessian=True, vhp=False)
    outer = jax.jacfwd if outer_jacobian_strategy == "forward-mode" else jax.jacrev
    return _unpack2(outer(grad_fn, argnums=argnums)(*xs), is_inputs_tuple, is_inputs_tuple)


def _second_order(func: Callable, inputs: Arrays, v: Arrays | None, create_graph: bool,
                  strict: bool, fn_name: str):
    _flags(create_graph=create_graph, strict=strict)
    is_inputs_tuple, xs = _inputs(inputs, fn_name)
    vs = _v(v, xs, is_inputs_tuple, fn_name,
            "the input to the user-provided function is")
    single = _single_output(func, fn_name)
    grad_fn = jax.grad(_scalar(single), argnums=tuple(range(len(xs))), has_aux=True)
    if strict:
        _check_second_order(single, lambda *ys: grad_fn(*ys)[0], xs, hessian=False,
                            vhp=fn_name == "vhp")
    return is_inputs_tuple, xs, vs, grad_fn


def vhp(func: Callable[..., jax.Array], inputs: Arrays, v: Arrays | None = None,
        create_graph: bool = False, strict: bool = False) -> tuple[jax.Array, Arrays]:
    """The vector-Hessian product `v^T H` of a scalar `func` at `inputs` (torch's
    `torch.autograd.functional.vhp`): reverse over reverse, the vjp of `jax.grad(func)`.

    Args:
      func: takes the arrays of `inputs` and returns a single array of a single element.
      inputs: an array or a tuple of arrays.
      v: shaped like `inputs`. May be None only when `inputs` is a single array of a single
        element (then ones).
      create_graph: accepted for torch's code: results are always differentiable in JAX.
      strict: raise a RuntimeError when the output or its gradient does not depend on an input.

    Returns:
      `(func_output, vhp)`: `func`'s output as it returned it, and `v^T H` shaped like `inputs`.

    >>> import jax.numpy as jnp
    >>> from jamp.autograd.functional import vhp
    >>> out, product = vhp(lambda x: (x ** 3).sum(), jnp.array([1.0, 2.0]),
    ...                    jnp.array([1.0, 1.0]))
    >>> product
    Array([ 6., 12.], dtype=float32)
    """
    is_inputs_tuple, xs, vs, grad_fn = _second_order(func, inputs, v, create_graph, strict,
                                                     "vhp")
    _, pullback, out = jax.vjp(grad_fn, *xs, has_aux=True)
    return out, _unpack(pullback(vs), is_inputs_tuple)


def hvp(func: Callable[..., jax.Array], inputs: Arrays, v: Arrays | None = None,
        create_graph: bool = False, strict: bool = False) -> tuple[jax.Array, Arrays]:
    """The Hessian-vector product `H v` of a scalar `func` at `inputs` (torch's
    `torch.autograd.functional.hvp`): forward over reverse, the jvp of `jax.grad(func)`, which
    also works through a `jax.custom_vjp` inside `func`.

    Args:
      func: takes the arrays of `inputs` and returns a single array of a single element.
      inputs: an array or a tuple of arrays.
      v: shaped like `inputs`. May be None only when `inputs` is a single array of a single
        element (then ones).
      create_graph: accepted for torch's code: results are always differentiable in JAX.
      strict: raise a RuntimeError when the output or its gradient does not depend on an input.

    Returns:
      `(func_output, hvp)`: `func`'s output as it returned it, and `H v` shaped like `inputs`.

    >>> import jax.numpy as jnp
    >>> from jamp.autograd.functional import hvp
    >>> out, product = hvp(lambda x, y: (x ** 2 * y).sum(),
    ...                    (jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])),
    ...                    (jnp.array([1.0, 0.0]), jnp.array([0.0, 0.0])))
    >>> product[1]
    Array([2., 0.], dtype=float32)
    """
    is_inputs_tuple, xs, vs, grad_fn = _second_order(func, inputs, v, create_graph, strict,
                                                     "hvp")
    _, product, out = jax.jvp(grad_fn, xs, vs, has_aux=True)
    return out, _unpack(product, is_inputs_tuple)
