"""`jamp.autograd.Function`: torch.autograd.Function for JAX, built on `jax.custom_vjp`.

A subclass defines static `forward(ctx, *args)` and `backward(ctx, *grad_outputs)` (or torch
2's `forward(*args)` with `setup_context(ctx, inputs, output)`) and is called as
`MyFn.apply(*args)`. Each call builds one `jax.custom_vjp` over the call's array arguments:

- Array arguments (JAX or NumPy arrays) are the function's inputs. Every other argument (a
  Python number, a string, None, a callable) is static: the custom_vjp closes over it, and its
  gradient is None. Arrays inside a container argument (a list, a dict) are passed through but
  get no gradient, as in torch: differentiating with respect to one raises.
- The fwd runs `forward` with `ctx.needs_input_grad` set from custom_vjp's symbolic zeros: an
  input is True exactly when JAX differentiates with respect to it. When nothing is
  differentiated the primal runs `forward` with every flag False.
- What `forward` leaves on `ctx` is the residual: the arrays (saved with `save_for_backward`,
  or stored as attributes, also inside tuples and dicts) travel as arrays; everything else is
  static and rides in the residual's tree structure. `backward` gets a ctx rebuilt from it.
- A cotangent that JAX knows to be zero (an unused output, an output marked non-differentiable,
  an integer output) reaches `backward` as zeros, or as None after
  `ctx.set_materialize_grads(False)`.
- `backward`'s result is checked: one gradient per input (trailing extra Nones are dropped, as
  torch does), None for non-array inputs, each array gradient of its input's shape (a gradient
  its input broadcasts to is summed down to it, as torch does) and cast to its input's dtype.

Forward mode. `jax.custom_vjp` and `jax.custom_jvp` cannot be combined on one function, so a
class with a static `jvp(ctx, *tangents)` takes a `jax.custom_jvp` path instead:

- A class with `jvp` and no `backward` always takes it. Forward mode runs `jvp`; reverse mode
  (`jax.grad`) transposes `jvp`, which JAX can do because a jvp is linear in its tangents.
- A class with both takes it when forward mode is the innermost differentiation acting on the
  call's inputs (`jax.jvp`, `jax.jacfwd`, also under `jax.vmap`), and the custom_vjp path
  otherwise. Which one acts is read from the inputs when `apply` runs, so a forward-mode
  transform applied from outside a staged region (`jax.jvp(jax.jit(f))`, a `lax.scan` body)
  finds the custom_vjp path and JAX refuses it ("can't apply forward-mode autodiff (jvp) to a
  custom_vjp function"). Differentiate inside the staged region there, or define `jvp` only.
- A class with `backward` only refuses forward mode when `apply` can see it, with torch's
  `NotImplementedError`, saying to define `jvp`; otherwise JAX's own error above.

Under `jamp.autocast`. The bwd of the custom_vjp is a `_Backward`, which autocast recognizes
(`jamp.transforms.interpreter.RetraceableCall`): it traces the call again for the dtypes its
inputs arrive in, so forward sees them as torch's forward does, and backward gets grads in the
dtypes forward's ops return under autocast. On the custom_jvp path, and when JAX rebuilds the
call (a `jax.vmap` inside the transformed function), forward sees the traced dtypes.

forward, backward and jvp run as traced code: Python side effects in them happen when JAX
traces them, not on every step of a jitted program.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jamp._checks import check_bool
from jamp.policy.cast import is_numeric_array
from jamp.policy.dtypes import is_inexact
from jamp import _jax_internals as jx
from jamp.transforms.custom_amp import cast_inputs_of
from jamp.transforms.interpreter import RetraceableCall

__all__ = ["Function", "FunctionCtx", "once_differentiable"]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class _Static:
    """Static values (Python numbers, strings, shapes, tree structures) carried in a residual's
    tree structure. JAX compares residual structures when it traces a fwd again, so equality is
    by value where the values allow it."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        if not isinstance(other, _Static):
            return NotImplemented
        try:
            return self.value is other.value or bool(self.value == other.value)
        except Exception:  # values with no truthful equality (arrays of flags, ...)
            return False

    def __hash__(self):
        return 0  # equal values must hash equal; values need not be hashable


class _Residual:
    """The residual of one `apply`: the arrays of a ctx and, static, everything else."""

    __slots__ = ("arrays", "static")

    def __init__(self, arrays, static: _Static):
        self.arrays = tuple(arrays)
        self.static = static


jax.tree_util.register_pytree_node(
    _Residual, lambda r: (r.arrays, r.static), lambda static, arrays: _Residual(arrays, static))


class FunctionCtx:
    """The `ctx` that a `Function`'s forward, setup_context, backward and jvp receive.

    Store arrays for the backward with `save_for_backward` and read them back from
    `saved_tensors`; store anything else as an attribute (`ctx.scale = 2.0`,
    `ctx.shape = x.shape`, also arrays). Attributes and saved arrays are the residuals of the
    underlying `jax.custom_vjp`: arrays travel as arrays, other values are static.

    Attributes:
      needs_input_grad: one bool per argument of `forward`: True exactly for the array inputs
        JAX differentiates with respect to in this call (reverse mode: the inputs `jax.grad`
        or `jax.vjp` asks about; forward mode: the inputs with a tangent). All False when
        nothing is differentiated and for non-array arguments.
    """

    __slots__ = ("_function", "needs_input_grad", "_saved", "_saved_forward",
                 "_non_differentiable", "_materialize", "_in_jvp", "__dict__")

    def __init__(self, function: str, needs_input_grad: tuple[bool, ...]):
        self._function = function
        self.needs_input_grad = tuple(needs_input_grad)
        self._saved: tuple = ()
        self._saved_forward: tuple = ()
        self._non_differentiable: tuple = ()
        self._materialize = True
        self._in_jvp = False

    def __repr__(self) -> str:
        return f"<FunctionCtx of {self._function}>"

    def save_for_backward(self, *tensors) -> None:
        """Saves arrays (or None) for `backward`, where `saved_tensors` returns them in order.
        Call it at most once per forward (a second call replaces the first).

        Raises:
          TypeError: for a value that is neither an array nor None (store those as ctx
            attributes).
        """
        self._saved = self._check_saved("save_for_backward", tensors)

    def save_for_forward(self, *tensors) -> None:
        """Saves arrays (or None) for `jvp`, where `saved_tensors` returns them in order."""
        self._saved_forward = self._check_saved("save_for_forward", tensors)

    def _check_saved(self, method: str, tensors: tuple) -> tuple:
        for i, t in enumerate(tensors):
            if t is not None and not is_numeric_array(t):
                raise TypeError(
                    f"ctx.{method} of {self._function} saves arrays (or None), but argument {i} "
                    f"is a {type(t).__name__}: store other values as ctx attributes "
                    "(ctx.name = value).")
        return tuple(tensors)

    @property
    def saved_tensors(self) -> tuple:
        """What forward saved: with `save_for_backward` (in backward) or with
        `save_for_forward` (in jvp), as a tuple; empty where it saved nothing that way (in jvp
        also when it saved only for backward, as in torch)."""
        return self._saved_forward if self._in_jvp else self._saved

    def mark_non_differentiable(self, *outputs) -> None:
        """Marks outputs of forward (the very arrays it returns) as non-differentiable: they
        carry no gradient, backward receives zeros (or None without materialized grads) for
        them, and their tangent in forward mode is zero."""
        for i, o in enumerate(outputs):
            if not is_numeric_array(o):
                raise TypeError(
                    f"ctx.mark_non_differentiable of {self._function} takes outputs of forward "
                    f"(arrays), but argument {i} is a {type(o).__name__}.")
        self._non_differentiable += tuple(outputs)

    def set_materialize_grads(self, value: bool) -> None:
        """With True (the default), backward receives zeros for the outputs whose gradient is
        known to be zero (unused, non-differentiable or integer outputs); with False it
        receives None for them, so that it can skip work. In jvp, the same holds for the
        tangents of inputs that are not differentiated."""
        self._materialize = check_bool("value", value)

    def mark_dirty(self, *tensors) -> None:
        """Accepted and ignored: JAX arrays are immutable, so no forward modifies its inputs in
        place. What torch calls a dirty input is, in JAX, a new array that forward returns as
        an output, and that output already carries its gradient. A forward ported from torch
        keeps working with its `mark_dirty` call once its in-place op is written as an
        out-of-place one (`x = x + 1` for `x.add_(1)`)."""
        del tensors

    # -- the residual: what forward left on ctx, as arrays and static values --------------

    def _flatten(self) -> tuple[list, _Static]:
        state = (self._saved, self._saved_forward, dict(self.__dict__))
        leaves, tree = jax.tree_util.tree_flatten(state)
        is_array = tuple(is_numeric_array(x) for x in leaves)
        arrays = [x for x, a in zip(leaves, is_array) if a]
        statics = tuple(None if a else x for x, a in zip(leaves, is_array))
        meta = (self._function, self.needs_input_grad, self._materialize)
        return arrays, _Static((tree, is_array, statics, meta))

    @classmethod
    def _unflatten(cls, arrays, static: _Static) -> "FunctionCtx":
        tree, is_array, statics, meta = static.value
        function, needs, materialize = meta
        it = iter(arrays)
        leaves = [next(it) if a else s for a, s in zip(is_array, statics)]
        saved, saved_forward, attributes = jax.tree_util.tree_unflatten(tree, leaves)
        ctx = cls(function, needs)
        ctx._saved, ctx._saved_forward, ctx._materialize = saved, saved_forward, materialize
        ctx.__dict__.update(attributes)
        return ctx


class _Call:
    """The arguments of one `apply`: which are inputs, and how to rebuild them from the flat
    arrays the custom_vjp / custom_jvp takes."""

    def __init__(self, cls: type[Function], args: tuple):
        self.cls = cls
        self.name = cls.__name__
        self.args = args
        self.names = _input_names(cls, len(args))
        self.is_input = tuple(is_numeric_array(a) for a in args)
        self.trees, self.leaves, self.owner = [], [], []
        for i, a in enumerate(args):
            leaves, tree = jax.tree_util.tree_flatten(a)
            self.trees.append(tree)
            self.leaves.append(leaves)
            self.owner += [i] * sum(is_numeric_array(x) for x in leaves)
        self.dynamic = [x for leaves in self.leaves for x in leaves if is_numeric_array(x)]
        self.avals = [jax.typeof(a) if inp else None
                      for a, inp in zip(args, self.is_input)]

    def describe(self, i: int) -> str:
        return f"input {i} ({self.names[i]})"

    def rebuild(self, dynamic) -> tuple:
        it = iter(dynamic)
        return tuple(
            jax.tree_util.tree_unflatten(
                tree, [next(it) if is_numeric_array(x) else x for x in leaves])
            for tree, leaves in zip(self.trees, self.leaves))

    def needs_input_grad(self, perturbed) -> tuple[bool, ...]:
        """One flag per argument from one flag per flat array; arrays inside containers must
        not be differentiated."""
        needs = [False] * len(self.args)
        for i, p in zip(self.owner, perturbed, strict=True):
            if not p:
                continue
            if not self.is_input[i]:
                raise TypeError(
                    f"{self.name}.apply: argument {i} ({self.names[i]}) is a "
                    f"{type(self.args[i]).__name__} holding an array that is being "
                    "differentiated, but only arrays passed directly as arguments are inputs "
                    "of a Function (as in torch): pass that array as an argument of its own.")
            needs[i] = True
        return tuple(needs)

    def cotangents(self, grads, needs) -> tuple:
        """backward's result, checked, as one cotangent (or None) per flat array."""
        if not isinstance(grads, tuple):
            grads = (grads,)
        n = len(self.args)
        if len(grads) > n and all(g is None for g in grads[n:]):
            grads = grads[:n]
        if len(grads) != n:
            raise RuntimeError(
                f"backward of {self.name} returned {_plural(len(grads), 'gradient')} for "
                f"{_plural(n, 'input')}: it must return one per argument of forward "
                f"({', '.join(self.names)}), None for those without a gradient.")
        out = []
        for i, g in enumerate(grads):
            num_arrays = self.owner.count(i)
            if not self.is_input[i]:
                if g is not None:
                    raise RuntimeError(
                        f"backward of {self.name} returned a gradient for {self.describe(i)}, "
                        f"which is a {type(self.args[i]).__name__}, not an array: return None "
                        "there.")
                out += [None] * num_arrays
                continue
            if g is not None:
                g = _fit(jnp.asarray(g), self.avals[i], f"backward of {self.name}: the "
                         f"gradient for {self.describe(i)}")
            out.append(g if needs[i] and is_inexact(self.avals[i]) else None)
        return tuple(out)


def _fit(g, aval, what: str):
    """`g` in `aval`'s shape and dtype: a gradient its input broadcasts to is summed down to it
    (torch's rule); any other shape is an error."""
    shape = tuple(aval.shape)
    if g.shape != shape:
        try:
            broadcasts = np.broadcast_shapes(shape, g.shape) == g.shape
        except ValueError:
            broadcasts = False
        if not broadcasts:
            raise RuntimeError(f"{what} has shape {g.shape}, expected {shape}.")
        lead = g.ndim - len(shape)
        g = g.sum(axis=tuple(range(lead)))
        g = g.sum(axis=tuple(k for k, s in enumerate(shape) if s == 1 and g.shape[k] != 1),
                  keepdims=True)
    return g.astype(aval.dtype) if g.dtype != aval.dtype else g


def _input_names(cls: type[Function], n: int) -> tuple[str, ...]:
    """The names of forward's parameters for `n` arguments (`args[k]` past a `*args`)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    if not _uses_setup_context(cls):
        params = params[1:]  # ctx
    names: list[str] = []
    for p in params:
        if p.kind == p.VAR_POSITIONAL:
            names += [f"{p.name}[{k}]" for k in range(n - len(names))]
            break
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    names += [f"argument {k}" for k in range(len(names), n)]
    return tuple(names[:n])


def _uses_setup_context(cls: type[Function]) -> bool:
    return cls.setup_context is not Function.setup_context


def _bind(cls: type[Function], args: tuple, kwargs: dict) -> tuple:
    """Keyword arguments bound to forward's positional parameters, defaults filled. torch fills
    the defaults for `setup_context` Functions even without keywords, so that `inputs` holds
    every argument of forward."""
    if not kwargs and not _uses_setup_context(cls):
        return args
    signature = inspect.signature(cls.forward)
    params = list(signature.parameters.values())
    if not _uses_setup_context(cls):
        params = params[1:]
    bound = signature.replace(parameters=params).bind(*args, **kwargs)
    bound.apply_defaults()
    if bound.kwargs:
        raise TypeError(f"{cls.__name__}.apply: forward's keyword-only parameters "
                        f"({', '.join(bound.kwargs)}) cannot be inputs of a Function: make "
                        "them positional.")
    return bound.args


def _forward(cls: type[Function], ctx: FunctionCtx, args: tuple):
    if _uses_setup_context(cls):
        output = cls.forward(*args)
        cls.setup_context(ctx, args, output)
        return output
    return cls.forward(ctx, *args)


class _Outputs:
    """forward's result split into the arrays the custom rule returns and the rest."""

    def __init__(self, name: str, output):
        self.is_tuple = isinstance(output, tuple)
        self.items = output if self.is_tuple else (output,)
        self.is_array = tuple(is_numeric_array(o) for o in self.items)
        for k, (o, a) in enumerate(zip(self.items, self.is_array)):
            if not a and any(is_numeric_array(x) for x in jax.tree_util.tree_leaves(o)):
                raise TypeError(
                    f"forward of {name} returned output {k} as a {type(o).__name__} holding "
                    "arrays: return an array, or a tuple whose items are arrays (or non-array "
                    "values).")
        self.arrays = tuple(o for o, a in zip(self.items, self.is_array) if a)

    def non_differentiable(self, ctx: FunctionCtx) -> tuple[bool, ...]:
        marked = ctx._non_differentiable
        return tuple(any(o is m for m in marked) or not is_inexact(jax.typeof(o))
                     for o in self.arrays)

    def assemble(self, arrays):
        it = iter(arrays)
        items = tuple(next(it) if a else o for o, a in zip(self.items, self.is_array))
        return items if self.is_tuple else items[0]


def _overrides(cls: type[Function], name: str, base_attr: str | None = None) -> bool:
    return getattr(cls, name) is not getattr(Function, base_attr or name)


def _backward_method(cls: type[Function]) -> Callable | None:
    backward, vjp = _overrides(cls, "backward"), _overrides(cls, "vjp", "backward")
    if backward and vjp:
        raise RuntimeError(f"{cls.__name__} defines both backward and vjp (two names for the "
                           "same method): keep one.")
    if backward:
        return cls.backward
    return cls.vjp if vjp else None


def _zero_or_none(aval, materialize: bool):
    return jnp.zeros(aval.shape, aval.dtype) if materialize else None


def _is_zero(ct) -> bool:
    return isinstance(ct, SymbolicZero) or ct.dtype == jax.dtypes.float0


def _primal(call: _Call, box: dict) -> Callable:
    """forward on the flat arrays, as runs when nothing is differentiated (every
    `needs_input_grad` False); it leaves forward's `_Outputs` in `box`."""

    def primal(*dynamic):
        ctx = FunctionCtx(call.name, (False,) * len(call.args))
        output = _forward(call.cls, ctx, call.rebuild(dynamic))
        box["outputs"] = outputs = _Outputs(call.name, output)
        return outputs.arrays

    primal.__name__ = call.name
    return primal


class _Backward(RetraceableCall):
    """The bwd of one call's custom_vjp: `backward` on the ctx its fwd left, with the grads it
    returns checked. It can also trace the whole call again for other input dtypes, which
    autocast does so that forward sees the dtypes torch's would (`RetraceableCall`)."""

    def __init__(self, call: _Call, backward: Callable):
        self.call = call
        self.backward = backward
        self.cast_inputs = cast_inputs_of(call.cls.forward)

    def __call__(self, residual, cts):
        static, (is_array, non_diff, avals) = residual.static.value
        ctx = FunctionCtx._unflatten(residual.arrays, static)
        cts = iter(zip(cts, non_diff, avals))
        grad_outputs = []
        for a in is_array:
            if not a:
                grad_outputs.append(None)
                continue
            ct, nd, aval = next(cts)
            grad_outputs.append(_zero_or_none(aval, ctx._materialize) if nd or _is_zero(ct)
                                else ct)
        return self.call.cotangents(self.backward(ctx, *grad_outputs), ctx.needs_input_grad)

    def retraced(self, *inputs):
        call = _Call(self.call.cls, self.call.rebuild(inputs))
        fn, _ = _custom_call(call)
        return fn(*call.dynamic)


def _vjp_call(call: _Call, backward: Callable) -> tuple[Callable, dict]:
    """The custom_vjp of one call, and the box where it leaves forward's `_Outputs`."""
    box: dict = {}
    cls = call.cls

    def fwd(*primals):
        needs = call.needs_input_grad([p.perturbed for p in primals])
        ctx = FunctionCtx(call.name, needs)
        output = _forward(cls, ctx, call.rebuild([p.value for p in primals]))
        box["outputs"] = outputs = _Outputs(call.name, output)
        arrays, static = ctx._flatten()
        layout = (outputs.is_array, outputs.non_differentiable(ctx),
                  tuple(jax.typeof(o) for o in outputs.arrays))
        return outputs.arrays, _Residual(arrays, _Static((static, layout)))

    fn = jax.custom_vjp(_primal(call, box))
    fn.defvjp(fwd, _Backward(call, backward), symbolic_zeros=True)
    return fn, box


def _jvp_call(call: _Call) -> tuple[Callable, dict]:
    """The custom_jvp of one call (for classes with a `jvp`), and its `_Outputs` box."""
    box: dict = {}
    cls = call.cls

    def rule(primals, tangents):
        flat_zero = [isinstance(t, SymbolicZero) for t in tangents]
        needs = call.needs_input_grad([not z for z in flat_zero])
        ctx = FunctionCtx(call.name, needs)
        box["outputs"] = outputs = _Outputs(call.name, _forward(cls, ctx, call.rebuild(primals)))
        flat = iter(zip(tangents, flat_zero))
        tangents_in = []
        for i, leaves in enumerate(call.leaves):
            mine = [next(flat) for x in leaves if is_numeric_array(x)]
            if not call.is_input[i]:
                tangents_in.append(None)
                continue
            (t, zero), = mine
            tangents_in.append(_zero_or_none(call.avals[i], ctx._materialize) if zero else t)
        ctx._in_jvp = True
        result = cls.jvp(ctx, *tangents_in)
        return outputs.arrays, _output_tangents(call.name, result, outputs, ctx)

    fn = jax.custom_jvp(_primal(call, box))
    fn.defjvp(rule, symbolic_zeros=True)
    return fn, box


def _output_tangents(name: str, result, outputs: _Outputs, ctx: FunctionCtx) -> tuple:
    """jvp's result, checked, as one tangent (or a symbolic zero) per output array."""
    if not isinstance(result, tuple):
        result = (result,)
    n = len(outputs.items)
    if len(result) != n:
        raise RuntimeError(f"jvp of {name} returned {_plural(len(result), 'tangent')} for "
                           f"{_plural(n, 'output')}: it must return one per output of forward, "
                           "None for those without a tangent.")
    non_diff = iter(outputs.non_differentiable(ctx))
    out: list[SymbolicZero | jax.Array] = []
    for k, (t, o, a) in enumerate(zip(result, outputs.items, outputs.is_array)):
        if not a:
            if t is not None:
                raise RuntimeError(f"jvp of {name} returned a tangent for output {k}, which is "
                                   f"a {type(o).__name__}, not an array: return None there.")
            continue
        aval = jax.typeof(o)
        non_differentiable = next(non_diff)
        if non_differentiable and t is not None:  # torch refuses it rather than dropping it
            raise RuntimeError(
                f"jvp of {name} returned a tangent for output {k}, which is non-differentiable "
                "(marked with ctx.mark_non_differentiable, or of an integer or bool dtype): "
                "return None there.")
        if non_differentiable or t is None:
            out.append(SymbolicZero(jx.tangent_aval(aval)))
            continue
        t = jnp.asarray(t)
        if t.shape != aval.shape:
            raise RuntimeError(f"jvp of {name}: the tangent for output {k} has shape {t.shape}, "
                               f"expected {aval.shape}.")
        out.append(t.astype(aval.dtype) if t.dtype != aval.dtype else t)
    return tuple(out)


def _custom_call(call: _Call) -> tuple[Callable, dict]:
    """The custom_vjp or custom_jvp of one call (see the module docs for which), and the box
    where it leaves forward's `_Outputs`."""
    cls = call.cls
    backward = _backward_method(cls)
    forward_mode = any(jx.innermost_autodiff(x) == "forward" for x in call.dynamic)
    if _overrides(cls, "jvp") and (backward is None or forward_mode):
        return _jvp_call(call)
    if forward_mode:
        # torch's type: a missing jvp is a NotImplementedError, which callers catch.
        raise NotImplementedError(
            f"{cls.__name__} defines no jvp: forward-mode differentiation (jax.jvp, "
            "jax.jacfwd) of a Function needs a static jvp(ctx, *tangents), as in torch.")
    return _vjp_call(call, backward or cls.backward)


class Function:
    """Base class of custom differentiable functions (torch.autograd.Function).

    Subclass it with a static `forward` and a static `backward`, then call the class's `apply`
    (never `forward` itself). `forward(ctx, *args)` computes the outputs (an array, or a tuple)
    and leaves on `ctx` what backward needs; torch 2's form, `forward(*args)` with a static
    `setup_context(ctx, inputs, output)`, is accepted too. `backward(ctx, *grad_outputs)`
    receives one gradient per output and returns one per argument of forward (None for
    non-array arguments and for inputs without a gradient). A static `jvp(ctx, *tangents)`
    (one tangent per argument in, one per output out) gives forward mode.

    It works under `jax.jit`, `jax.grad`, `jax.vmap` and, when backward is written with
    differentiable jax.numpy operations, grad of grad. Underneath each `apply` is a
    `jax.custom_vjp` (a `jax.custom_jvp` for classes with `jvp`, see the module docs).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.autograd.function import Function
      >>> class Exp(Function):
      ...     @staticmethod
      ...     def forward(ctx, i):
      ...         result = jnp.exp(i)
      ...         ctx.save_for_backward(result)
      ...         return result
      ...
      ...     @staticmethod
      ...     def backward(ctx, grad_output):
      ...         result, = ctx.saved_tensors
      ...         return grad_output * result
      >>> jax.grad(lambda x: Exp.apply(x).sum())(jnp.zeros(2))
      Array([1., 1.], dtype=float32)
    """

    @staticmethod
    def forward(*args, **kwargs):
        """Computes the outputs: `forward(ctx, *args)`, or `forward(*args)` with
        `setup_context`. Define it as a staticmethod of the subclass."""
        raise NotImplementedError("A Function subclass must define a static forward.")

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple, output) -> None:
        """torch 2's form: stores on `ctx` what backward needs, from forward's `inputs` (a
        tuple) and `output`. Define it together with a `forward(*args)` that takes no ctx."""
        raise NotImplementedError

    @staticmethod
    def backward(ctx: FunctionCtx, *grad_outputs):
        """Returns one gradient per argument of forward, from one per output."""
        raise NotImplementedError(
            f"{ctx._function} defines no backward (or vjp): reverse-mode differentiation "
            "(jax.grad, jax.vjp) of a Function needs a static backward(ctx, *grad_outputs), "
            "or a static jvp(ctx, *tangents) for JAX to transpose.")

    vjp = backward  # torch's other name for backward

    @staticmethod
    def jvp(ctx: FunctionCtx, *tangents):
        """Returns one tangent per output of forward, from one per argument (forward mode)."""
        raise NotImplementedError

    @classmethod
    def apply(cls, *args, **kwargs) -> Any:
        """Runs the function: forward's outputs, differentiable by JAX through backward."""
        args = _bind(cls, args, kwargs)
        call = _Call(cls, args)
        if not call.dynamic:  # nothing JAX could differentiate or trace
            return _forward(cls, FunctionCtx(call.name, (False,) * len(args)), args)
        fn, box = _custom_call(call)
        arrays = fn(*call.dynamic)
        return box["outputs"].assemble(arrays)


def once_differentiable(backward: Callable) -> Callable:
    """Marks a Function's backward as not differentiable again (torch's decorator).

    Gradients of the Function are unchanged; differentiating through its backward (grad of
    grad, forward mode over reverse mode) raises a RuntimeError naming the Function, instead of
    differentiating the backward's operations. Use it for a backward that is not written with
    differentiable operations, so that a second derivative fails loudly rather than silently
    wrong.

    Put it under `@staticmethod`:

        @staticmethod
        @once_differentiable
        def backward(ctx, grad_output): ...
    """

    @functools.wraps(backward)
    def wrapper(ctx: FunctionCtx, *grad_outputs):
        ctx_arrays, ctx_static = ctx._flatten()
        grad_leaves, grad_tree = jax.tree_util.tree_flatten(grad_outputs)
        n = len(ctx_arrays)
        box: dict = {}

        @jax.custom_jvp
        def run(*arrays):
            inner = FunctionCtx._unflatten(arrays[:n], ctx_static)
            grads = backward(inner, *jax.tree_util.tree_unflatten(grad_tree, arrays[n:]))
            leaves, box["tree"] = jax.tree_util.tree_flatten(grads)
            return [jnp.asarray(g) for g in leaves]

        @run.defjvp
        def refuse(primals, tangents):
            raise RuntimeError(
                f"The backward of {ctx._function} is marked @once_differentiable, so it cannot "
                "be differentiated again (grad of grad, or forward mode over reverse mode): "
                "write it with differentiable jax.numpy operations and drop the decorator.")

        grads = run(*ctx_arrays, *grad_leaves)
        return jax.tree_util.tree_unflatten(box["tree"], grads)

    return wrapper
