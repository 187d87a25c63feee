"""Higher-order primitives under an interpreter: each helper evaluates the equation's bodies
with a body evaluator (`jamp.walker.evaluate.Body`: `(closed, args) -> (outputs, extras)`,
`Interpreter.body()` makes one) and rebuilds the same control flow around them.

Values may be pytrees (the debugger's (low, shadow) pairs): the loops carry and slice every
leaf. Side results (`extras`, a dict of arrays) leave the loops and branches:

- `scan`: stacked per iteration (a leading axis of the scan's length);
- `while_loop`: combined in the carry with `combine`, from zeros shaped by one abstract run of
  the body;
- `switch`: every branch returns the union of the branches' extras, zeros for those it does
  not make.

Zeros are the neutral side result: extras are maxima, sums, counts or flags. A loop's carries
keep their dtypes (a body's result is cast to its carry's dtype), and a branch's outputs take
the promoted dtype of the branches' (interpreters may change dtypes per branch).

Each helper returns `(outputs, extras)`; the helpers that rebuild a primitive whose outputs
are fixed by its interface (`jit`, `custom_jvp`, `custom_vjp`, `shard_map`) take bodies
without extras and return `{}`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jamp import _jax_internals as jx
from jamp.walker.evaluate import Body

__all__ = ["CALL_PRIMITIVES", "call", "cast_to_avals", "custom_jvp", "custom_vjp", "jit", "remat",
           "scan", "shard_map", "switch", "while_loop", "zeros"]

# What `call` inlines: function calls, remat, and the primal body of a custom derivative.
CALL_PRIMITIVES = jx.CALLS | {"custom_vjp_call"}


def call(eqn: jx.JaxprEqn, invals: Sequence[Any], body: Body) -> tuple[list, dict]:
    """A call (`jit`, `closed_call`, `remat2`, `custom_jvp_call`, `custom_vjp_call`) inlined:
    its body evaluated in its place. What the call added around the body is dropped (a jit's
    settings, a remat policy, a custom derivative rule): for programs that are only run, not
    differentiated again."""
    if eqn.primitive.name == "custom_vjp_call":
        closed = jx.custom_call_body(eqn.params)
    else:
        closed = jx.call_body(eqn)
    return body(closed, list(invals))


def jit(eqn: jx.JaxprEqn, invals: Sequence[Any], body: Body | jx.ClosedJaxpr
        ) -> tuple[list, dict]:
    """A `jit` or `closed_call` re-bound with its body evaluated by `body`, traced for the
    current arrays `invals` (their dtypes may differ from the traced ones); its settings (name,
    shardings, donation, inlining) kept. The body's outputs may change dtype, not number.

    An interpreter that keeps the bodies it transformed (autocast traces a body once per
    program for the same inputs, so that a helper called many times lowers to one function)
    passes that body, a closed jaxpr, instead of a body evaluator."""
    key = jx.call_body_key(eqn.params)
    if isinstance(body, jx.ClosedJaxpr):
        closed = body
    else:
        closed = jx.trace_closed(_without_extras(body, jx.call_body(eqn)),
                                 [jax.typeof(v) for v in invals])
    return jx.bind(eqn, dict(eqn.params, **{key: closed}), list(invals)), {}


def remat(eqn: jx.JaxprEqn, invals: Sequence[Any], body: Body) -> tuple[list, dict]:
    """A `jax.checkpoint` rebuilt around its body evaluated by `body`, with its policy."""
    closed = jx.remat_body(eqn.params)
    outs, extras = jax.checkpoint(lambda *args: body(closed, list(args)),
                                  **jx.remat_options(eqn.params))(*invals)
    return list(outs), extras


def scan(eqn: jx.JaxprEqn, invals: Sequence[Any], body: Body) -> tuple[list, dict]:
    """A `lax.scan` rebuilt around its body evaluated by `body` (length, reverse, unroll
    kept); the extras come out stacked, one row per iteration."""
    closed, num_consts, num_carry, options = jx.scan_parts(eqn.params)
    consts = list(invals[:num_consts])
    init = list(invals[num_consts:num_consts + num_carry])
    xs = list(invals[num_consts + num_carry:])

    def step(carry, x):
        outs, extras = body(closed, [*consts, *carry, *x])
        return _like(outs[:num_carry], carry), (outs[num_carry:], extras)

    carry, (ys, extras) = lax.scan(step, init, xs, **options)
    return [*carry, *ys], extras


def while_loop(eqn: jx.JaxprEqn, invals: Sequence[Any], body: Body,
               cond: Callable[[jx.ClosedJaxpr, list], Any],
               combine: Callable[[Any, Any], Any] | None = None) -> tuple[list, dict]:
    """A `lax.while_loop` rebuilt around its body evaluated by `body`.

    Args:
      cond: `(condition, args) -> predicate`: evaluates the loop's condition on its consts and
        the carries (the interpreter's values); its extras are not kept.
      combine: `(extras so far, an iteration's) -> extras` (per key a `max`, `|` or `+`, or
        a choice among iterations); needed only when the body has extras, which ride in the
        carry from zeros.
    """
    cond_closed, closed, cond_n, body_n = jx.while_parts(eqn.params)
    cond_consts = list(invals[:cond_n])
    consts = list(invals[cond_n:cond_n + body_n])
    init = list(invals[cond_n + body_n:])
    shapes = jax.eval_shape(lambda carry: body(closed, [*consts, *carry])[1], init)
    if shapes and combine is None:
        raise ValueError("while_loop: the body has extras; pass `combine` to merge them "
                         "across iterations.")

    def cond_fn(state):
        return cond(cond_closed, [*cond_consts, *state[0]])

    def body_fn(state):
        carry, extras = state
        outs, new = body(closed, [*consts, *carry])
        return _like(outs, carry), combine(extras, new) if extras else extras

    carry, extras = lax.while_loop(cond_fn, body_fn, (init, zeros(shapes)))
    return list(carry), extras


def switch(eqn: jx.JaxprEqn, index: Any, operands: Sequence[Any],
           body: Body | Sequence[Body]) -> tuple[list, dict]:
    """A `cond` equation (`lax.cond`, `lax.switch`) re-bound with its branches evaluated by
    `body` (or by `body[k]` for branch `k`, where an interpreter tells branches apart); `index`
    is the branch index as an array (the interpreter's value of the equation's first operand,
    which `operands` follow). Every branch returns the union of the branches' extras, and its
    outputs in the promoted dtypes of the branches'."""
    branches = eqn.params["branches"]
    bodies = list(body) if isinstance(body, Sequence) else [body] * len(branches)
    leaves, tree = jax.tree_util.tree_flatten(list(operands))
    avals = [jax.typeof(leaf) for leaf in leaves]
    shapes = [jax.eval_shape(lambda *flat, k=k: bodies[k](branches[k], _unflat(tree, flat)),
                             *leaves) for k in range(len(branches))]
    union: dict = {}
    for _, extras in shapes:
        union.update(extras)
    out_types = jax.tree_util.tree_map(
        lambda *leaves: jnp.result_type(*(leaf.dtype for leaf in leaves)),
        *[outs for outs, _ in shapes])
    out_tree: list = []

    def branch(k):
        def run(*flat):
            outs, extras = bodies[k](branches[k], _unflat(tree, flat))
            outs = jax.tree_util.tree_map(lax.convert_element_type, outs, out_types)
            filled = {key: extras[key] if key in extras else zeros(shape)
                      for key, shape in union.items()}
            out_leaves, treedef = jax.tree_util.tree_flatten((outs, filled))
            out_tree[:] = [treedef]
            return out_leaves
        return jx.trace_closed(run, avals)

    new = tuple(branch(k) for k in range(len(branches)))
    flat_out = jx.bind(eqn, dict(eqn.params, branches=new), [index, *leaves])
    outs, extras = jax.tree_util.tree_unflatten(out_tree[0], flat_out)
    return list(outs), extras


def custom_jvp(eqn: jx.JaxprEqn, invals: Sequence[Any], body: Body) -> tuple[list, dict]:
    """A `custom_jvp_call` re-bound with its primal body and the user's jvp rule evaluated by
    `body`, each traced for the current arrays `invals`; the rule's outputs are cast to the
    primal body's output types (and their tangents'), as JAX requires them to agree."""
    num_consts = jx.custom_call_num_consts(eqn.params)
    avals = [jax.typeof(v) for v in invals]
    primal = jx.trace_closed(_without_extras(body, jx.custom_call_body(eqn.params)), avals)
    primal_avals = avals[num_consts:]
    out_avals = list(primal.out_avals)

    def transform(jvp: jx.ClosedJaxpr, zeros_in: tuple, zeros_out: tuple) -> jx.ClosedJaxpr:
        tangents = [jx.tangent_aval(a) for a, z in zip(primal_avals, zeros_in, strict=True)
                    if not z]
        out_tangents = [jx.tangent_aval(a) for a, z in zip(out_avals, zeros_out, strict=True)
                        if not z]

        def rule(*args):
            outs, extras = body(jvp, list(args))
            _no_extras(extras)
            return cast_to_avals(outs, out_avals + out_tangents)

        return jx.trace_closed(rule, primal_avals + tangents)

    params = jx.custom_jvp_params(eqn.params, primal, transform)
    return jx.bind(eqn, params, list(invals)), {}


def custom_vjp(eqn: jx.JaxprEqn, invals: Sequence[Any], body: Body,
               wrap_bwd: Callable[[Callable], Callable] = lambda bwd: bwd
               ) -> tuple[list, dict]:
    """A `custom_vjp_call` re-bound with its primal body and the user's fwd evaluated by `body`
    with their interfaces kept (inputs and outputs in the traced types: the user's bwd was
    written for them), and the user's bwd wrapped by `wrap_bwd`. `invals` are cast to the
    traced types."""
    def kept(closed: jx.ClosedJaxpr) -> jx.ClosedJaxpr:
        def run(*args):
            outs, extras = body(closed, list(args))
            _no_extras(extras)
            return cast_to_avals(outs, closed.out_avals)
        return jx.trace_closed(run, closed.in_avals)

    params = jx.custom_vjp_params(eqn.params, kept(jx.custom_call_body(eqn.params)), kept,
                                  wrap_bwd)
    return jx.bind(eqn, params, cast_to_avals(invals, [a.aval for a in eqn.invars])), {}


def shard_map(eqn: jx.JaxprEqn, invals: Sequence[Any], body: Body) -> tuple[list, dict]:
    """A `jax.shard_map` rebuilt around its body evaluated by `body` (mesh, specs and checks
    kept)."""
    closed = jx.shard_map_body(eqn.params)
    fn = jax.shard_map(lambda *args: tuple(_without_extras(body, closed)(*args)),
                       **jx.shard_map_options(eqn.params))
    return list(fn(*invals)), {}


# -- values ---------------------------------------------------------------------------------------

def zeros(shapes: Any) -> Any:
    """Zeros shaped as `shapes` (a pytree of `jax.ShapeDtypeStruct`): neutral side results."""
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def cast_to_avals(values: Sequence[Any], avals: Sequence[Any]) -> list:
    """Each array of `values` in the dtype of its aval (others as they are)."""
    return [lax.convert_element_type(v, a.dtype) if hasattr(v, "dtype") and hasattr(a, "dtype")
            and v.dtype != a.dtype else v for v, a in zip(values, avals, strict=True)]


def _like(values: Sequence[Any], reference: Sequence[Any]) -> list:
    """`values` (pytrees) in the dtypes of `reference`: a loop's carries keep their type."""
    def like(v, r):
        dtype = getattr(r, "dtype", None)
        return lax.convert_element_type(v, dtype) if dtype is not None and v.dtype != dtype \
            else v
    return [jax.tree_util.tree_map(like, v, r) for v, r in zip(values, reference, strict=True)]


def _unflat(tree: Any, leaves: Sequence[Any]) -> list:
    return list(jax.tree_util.tree_unflatten(tree, list(leaves)))


def _no_extras(extras: dict) -> None:
    if extras:
        raise ValueError("this primitive's outputs are fixed by its interface: its body "
                         "cannot return extras (inline it with `call`, or leave it opaque).")


def _without_extras(body: Body, closed: Any) -> Callable:
    """`body` on `closed` as a function of the body's arguments that returns its outputs."""
    def run(*args):
        outs, extras = body(closed, list(args))
        _no_extras(extras)
        return outs
    return run
