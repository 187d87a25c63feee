"""The autocast interpreter: one loop over a jaxpr's equations and one rule table.

First-order equations are re-bound with their inputs cast as `autocast_rules` decides.
Higher-order primitives get a rule each that transforms the sub-jaxprs and re-binds the same
primitive, so structure, custom derivative rules and loop carry types survive:

- `jit` (and `closed_call`), `checkpoint`/`remat`, `shard_map`, `custom_jvp_call`: the body is
  transformed for the current input dtypes and may return lower-precision values, as the same
  ops would inline; a custom_jvp's rule is transformed for the same dtypes.
- `scan`, `while`, `cond`, `custom_vjp_call`: the body is transformed with its interface kept
  (inputs and outputs in the traced dtypes), because carries must keep their type and the
  user's bwd was written for those dtypes. The user's fwd is transformed like the body; the
  user's bwd runs with autocast off (torch's rule for custom backward functions) unless it is
  wrapped in `jamp.custom_bwd`.

Each distinct sub-jaxpr is transformed once per program (per region and input types).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp.transforms import _jax_internals as jx
from jamp.transforms import autocast_rules as rules
from jamp.transforms.autocast_rules import Region


@dataclasses.dataclass
class Context:
    """Per-program state of one autocast trace (never global).

    Attributes:
      cache_enabled: cast each value to each dtype once per jaxpr (torch's weight cache).
      jaxprs: transformed sub-jaxprs, keyed by (kind, sub-jaxpr, region, input types).
      regions: the region of each (enclosing region, name stack).
    """

    cache_enabled: bool = True
    jaxprs: dict = dataclasses.field(default_factory=dict)
    regions: dict = dataclasses.field(default_factory=dict)

    def region_for(self, region: Region, eqn) -> Region:
        stack = jx.name_stack(eqn)
        key = (region, stack)
        found = self.regions.get(key)
        if found is None:
            found = rules.apply_markers(region, rules.parse_markers(str(stack)))
            self.regions[key] = found
        return found


def dtype_of(x):
    return x.dtype


def cast(x, dtype):
    """Casts a value; numpy scalars (literals) stay numpy so they remain literals."""
    if dtype_of(x) == dtype:
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x, dtype=dtype)
    return lax.convert_element_type(x, dtype)


def cast_to_avals(values: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
    """Casts each castable floating value to the dtype of its aval (e.g. back to the traced
    dtypes); other values are returned as they are."""
    return [cast(v, a.dtype) if hasattr(v, "dtype") and rules.is_castable(dtype_of(v))
            and rules.is_castable(a.dtype) else v for v, a in zip(values, avals)]


def _avals_key(avals) -> tuple:
    return tuple((tuple(a.shape), a.dtype, bool(getattr(a, "weak_type", False)))
                 for a in avals)


def eval_jaxpr(closed: jx.ClosedJaxpr, args: Sequence[Any], region: Region,
               ctx: Context) -> list[Any]:
    """Evaluates `closed` on `args` with autocast, binding on whatever trace is current."""
    jaxpr = closed.jaxpr
    env: dict = {}
    casts: dict = {}

    def read(atom):
        if isinstance(atom, jx.Literal):
            # As a numpy value of the literal's type, so casts of it stay literals.
            return np.asarray(atom.val, dtype=atom.aval.dtype) if _is_floating(atom.aval) \
                else atom.val
        return env[atom]

    def read_cast(atom, dtype):
        value = read(atom)
        if dtype is None or dtype_of(value) == dtype:
            return value
        if not ctx.cache_enabled or isinstance(atom, jx.Literal):
            return cast(value, dtype)
        key = (atom, dtype)
        if key not in casts:
            casts[key] = cast(value, dtype)
        return casts[key]

    env.update(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        eqn_region = ctx.region_for(region, eqn)
        rule = HIGHER_ORDER_RULES.get(eqn.primitive.name)
        with jx.equation_context(eqn):
            if rule is not None:
                outs = rule(eqn, [read(a) for a in eqn.invars], eqn_region, ctx)
            elif jx.jaxprs_in_params(eqn.params):
                outs = _opaque(eqn, [read(a) for a in eqn.invars])
            else:
                outs = _first_order(eqn, eqn_region, read, read_cast)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _is_floating(aval) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _follows(atom, value) -> bool:
    """Python-scalar-like operands: rank-0 literals, and weak-typed values (a Python scalar
    argument, or a literal passed into a sub-jaxpr, see `_weak_literal_avals`)."""
    if isinstance(atom, jx.Literal):
        return np.ndim(atom.val) == 0
    return bool(getattr(atom.aval, "weak_type", False)
                or getattr(jx.typeof(value), "weak_type", False))


def _first_order(eqn, region: Region, read, read_cast) -> list[Any]:
    name = eqn.primitive.name
    if name == "convert_element_type":
        # An explicit cast in the program is honoured as written; one to the dtype a value
        # already has is dropped.
        value = read(eqn.invars[0])
        new_dtype, weak_type = jx.convert_target(eqn)
        if dtype_of(value) == np.dtype(new_dtype) and not weak_type:
            return [value]
        return jx.bind(eqn, eqn.params, [value])
    if name == "optimization_barrier" and region.cast_inputs is not None:
        values = [read(a) for a in eqn.invars]
        targets = [region.cast_inputs if rules.is_castable(dtype_of(v)) else None
                   for v in values]
        return jx.bind(eqn, eqn.params, [cast(v, t) if t is not None else v
                                         for v, t in zip(values, targets)])
    floating = [_is_floating(a.aval) for a in eqn.invars]
    if not any(floating):
        return jx.bind(eqn, eqn.params, [read(a) for a in eqn.invars])
    traced = [np.dtype(a.aval.dtype) if f else None for a, f in zip(eqn.invars, floating)]
    current = [dtype_of(read(a)) if f else None for a, f in zip(eqn.invars, floating)]
    targets = rules.input_targets(name, region, current, traced,
                                  [_follows(a, read(a)) for a in eqn.invars])
    invals = [read_cast(a, t) for a, t in zip(eqn.invars, targets)]
    first = floating.index(True)
    result = dtype_of(invals[first])
    params = jx.with_result_dtype(eqn.params, traced[first], result)
    if result in _BELOW_FP32 and rules.accumulates_in_fp32(name, region):
        invals = [cast(v, rules.FLOAT32) if f else v for v, f in zip(invals, floating)]
        params = jx.with_result_dtype(params, result, rules.FLOAT32)
        return [cast(o, result) if _is_floating(o) else o for o in jx.bind(eqn, params, invals)]
    return jx.bind(eqn, params, invals)


_BELOW_FP32 = frozenset(np.dtype(d) for d in (jnp.float16, jnp.bfloat16))


def _opaque(eqn, invals) -> list[Any]:
    """A higher-order primitive without a rule runs untransformed in its traced dtypes."""
    return jx.bind(eqn, eqn.params, _to_traced(eqn, invals))


def _to_traced(eqn, invals) -> list[Any]:
    return cast_to_avals(invals, [a.aval for a in eqn.invars])


# -- transformed sub-jaxprs -------------------------------------------------------------------

def specialized(closed: jx.ClosedJaxpr, region: Region, ctx: Context,
                values: Sequence[Any]) -> jx.ClosedJaxpr:
    """`closed` transformed for the dtypes of `values`; outputs in whatever dtypes result."""
    avals = _weak_literal_avals(values)
    key = ("specialized", closed, region, _avals_key(avals))
    if key not in ctx.jaxprs:
        ctx.jaxprs[key] = jx.trace_closed(
            lambda *args: eval_jaxpr(closed, args, region, ctx), avals)
    return ctx.jaxprs[key]


def _weak_literal_avals(values) -> list[Any]:
    """Avals of the values passed into a sub-jaxpr; rank-0 literals (numpy scalars here) become
    weak-typed, so that inside the body they still follow the other operand."""
    return [jx.weak_aval(v) if isinstance(v, (np.ndarray, np.generic)) and np.ndim(v) == 0
            else jx.typeof(v) for v in values]


def interface_kept(closed: jx.ClosedJaxpr, region: Region, ctx: Context) -> jx.ClosedJaxpr:
    """`closed` transformed with its input and output types unchanged (casts inside)."""
    key = ("kept", closed, region)
    if key not in ctx.jaxprs:
        ctx.jaxprs[key] = jx.trace_closed(
            lambda *args: _eval_kept(closed, args, region, ctx), closed.in_avals)
    return ctx.jaxprs[key]


# -- higher-order rules -----------------------------------------------------------------------

def _jit_rule(eqn, invals, region, ctx):
    key = jx.call_body_key(eqn.params)
    new = specialized(eqn.params[key], region, ctx, invals)
    return jx.bind(eqn, dict(eqn.params, **{key: new}), invals)


def _remat_rule(eqn, invals, region, ctx):
    body = jx.remat_body(eqn.params)
    fn = jax.checkpoint(lambda *args: eval_jaxpr(body, args, region, ctx),
                        **jx.remat_options(eqn.params))
    return list(fn(*invals))


def _shard_map_rule(eqn, invals, region, ctx):
    body = jx.shard_map_body(eqn.params)
    fn = jax.shard_map(lambda *args: tuple(eval_jaxpr(body, args, region, ctx)),
                       **jx.shard_map_options(eqn.params))
    return list(fn(*invals))


def _kept_rule(eqn, invals, region, ctx):
    """Loops and branches: their sub-jaxprs keep their interface."""
    params = dict(eqn.params)
    for key in jx.KEPT_BODY_PARAMS[eqn.primitive.name]:
        value = params[key]
        if isinstance(value, (tuple, list)):
            params[key] = type(value)(interface_kept(v, region, ctx) for v in value)
        else:
            params[key] = interface_kept(value, region, ctx)
    return jx.bind(eqn, params, _to_traced(eqn, invals))


def _custom_jvp_rule(eqn, invals, region, ctx):
    # Specialized to the current dtypes, like jit: jax.nn.relu of a bfloat16 value stays
    # bfloat16. The user's jvp rule is traced for the same dtypes and its outputs are cast to
    # the primal body's, so primal and tangent types agree as JAX requires.
    call = specialized(jx.custom_call_body(eqn.params), region, ctx, invals)
    primal_avals = [jx.typeof(v) for v in invals[jx.custom_call_num_consts(eqn.params):]]
    out_avals = call.out_avals

    def transform(jvp_closed, zeros, out_zeros):
        tangent_avals = [jx.tangent_aval(a) for a, z in zip(primal_avals, zeros) if not z]
        tangent_out_avals = [a for a, z in zip(out_avals, out_zeros) if not z]

        def body(*args):
            outs = eval_jaxpr(jvp_closed, args, region, ctx)
            return cast_to_avals(outs, list(out_avals) + tangent_out_avals)

        return jx.trace_closed(body, primal_avals + tangent_avals)

    return jx.bind(eqn, jx.custom_jvp_params(eqn.params, call, transform), invals)


def _custom_vjp_rule(eqn, invals, region, ctx):
    call = interface_kept(jx.custom_call_body(eqn.params), region, ctx)
    bwd_region = region.off_as_is()

    def wrap_bwd(bwd: Callable) -> Callable:
        # The user's bwd is traced and evaluated with autocast off (or, under custom_bwd, in
        # the forward's region); symbolic zeros pass around the trace untouched.
        def new_bwd(*args):
            if any(jx.is_symbolic_zero(a) for a in args):
                return bwd(*args)
            seen: dict = {}

            def arrays_only(*a):
                cts, logs = jx.split_bwd_result(bwd(*a))
                seen["cts"], seen["logs"] = cts, logs
                leaves, seen["logs_tree"] = jax.tree_util.tree_flatten(
                    None if jx.has_no_logs(logs) else logs)
                return [c for c in cts if not jx.is_symbolic_zero(c)] + leaves

            closed = jx.trace_closed(arrays_only, [jx.typeof(a) for a in args])
            values = _eval_kept(closed, args, bwd_region, ctx)
            num_cts = len(values) - seen["logs_tree"].num_leaves
            arrays = iter(values[:num_cts])
            cts = [c if jx.is_symbolic_zero(c) else next(arrays) for c in seen["cts"]]
            logs = jax.tree_util.tree_unflatten(seen["logs_tree"], values[num_cts:])
            return jx.join_bwd_result(cts, logs, seen["logs"])

        return new_bwd

    params = jx.custom_vjp_params(eqn.params, call,
                                  lambda cj: interface_kept(cj, region, ctx), wrap_bwd)
    return jx.bind(eqn, params, _to_traced(eqn, invals))


def _eval_kept(closed, args, region, ctx) -> list[Any]:
    return cast_to_avals(eval_jaxpr(closed, args, region, ctx), closed.out_avals)


HIGHER_ORDER_RULES: dict[str, Callable] = {
    "jit": _jit_rule,
    "pjit": _jit_rule,
    "closed_call": _jit_rule,
    "checkpoint": _remat_rule,
    "remat2": _remat_rule,
    "remat": _remat_rule,
    "shard_map": _shard_map_rule,
    "scan": _kept_rule,
    "while": _kept_rule,
    "cond": _kept_rule,
    "custom_jvp_call": _custom_jvp_rule,
    "custom_vjp_call": _custom_vjp_rule,
}
