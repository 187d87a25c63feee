"""Which outputs of a function depend, differentiably, on which of its inputs: torch's
`requires_grad` propagation, read off the function's jaxpr.

torch marks a tensor as requiring grad when a differentiable op computes it from one that does;
integer and bool results, and `detach()`ed ones, never require grad. The jaxpr analogue: a value
depends on input i when a chain of equations leads from input i to it through floating-point
(or complex) values, never through `stop_gradient`. So `x > 0` cut the chain (a bool), as do
`argmax` (an integer) and `lax.stop_gradient`, while `jnp.floor(x)` keeps it, as in torch. Values a
function closes over are constants: they depend on no input.

The answer is read from the program, not from values, so it is the same eagerly and under
`jax.jit`: the function is traced once more at its inputs' shapes and dtypes. An equation's
outputs take their inputs' masks by a rule per primitive (`_FLOW_RULES`: through a call's
body, through any of a cond's branches, from every operand by default), as the autocast
interpreter rewrites each primitive by a rule.

What it shares with the other analyses: `contains` lists equations with the one walk
(`jamp.walker.walk`), and the flow reads bodies with the same accessors (`_jax_internals`).
The flow itself is not an equation listing: a body's inputs take the masks of the equation's
operands, so it runs body by body with its own environment, as an evaluator would, only over
bitmasks; a loop's body is not entered (each of its outputs may depend on each operand).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from jamp import _jax_internals as jx
from jamp.policy.dtypes import is_inexact
from jamp.walker.walk import equations


def dependence(fn: Callable[..., tuple], args: Sequence[Any]) -> tuple[tuple[bool, ...], ...]:
    """For `fn(*args)` returning a tuple of arrays, `deps[i][j]`: output i depends on input j.

    Args:
      fn: a function of arrays returning a tuple of arrays.
      args: its inputs: arrays, possibly being traced.
    """
    closed = jx.trace_closed(fn, [jax.typeof(a) for a in args])
    jaxpr = closed.jaxpr
    masks = _flow(jaxpr, [_bit(v, j) for j, v in enumerate(jaxpr.invars)])
    return tuple(tuple(bool(m >> j & 1) for j in range(len(args))) for m in masks)


def contains(fn: Callable[..., Any], args: Sequence[Any], primitive: str) -> bool:
    """True when `fn(*args)` traces to `primitive`, in its body or any nested one."""
    closed = jx.trace_closed(fn, [jax.typeof(a) for a in args])
    return any(eqn.primitive.name == primitive for eqn in equations(closed))


def _bit(var, j: int) -> int:
    return 1 << j if is_inexact(var.aval) else 0


def _flow(jaxpr, in_masks: list[int]) -> list[int]:
    """The input bitmask of each output of `jaxpr`, given those of its inputs."""
    env: dict = dict(zip(jaxpr.invars, in_masks, strict=True))

    def read(atom) -> int:
        return 0 if isinstance(atom, jx.Literal) else env.get(atom, 0)  # consts: none

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        outs = _FLOW_RULES.get(eqn.primitive.name, _from_every_operand)(eqn, ins)
        for var, mask in zip(eqn.outvars, outs, strict=True):
            env[var] = mask if is_inexact(var.aval) else 0
    return [read(v) for v in jaxpr.outvars]


# -- the rules: each output's mask from the operands' masks ---------------------------------

def _from_every_operand(eqn, ins: list[int]) -> list[int]:
    """Loops and every first-order primitive: each output may depend on each operand."""
    union = 0
    for mask in ins:
        union |= mask
    return [union] * len(eqn.outvars)


def _cut(eqn, ins: list[int]) -> list[int]:
    """`stop_gradient`: nothing flows through."""
    return [0] * len(eqn.outvars)


def _through(body):
    """The rule of a primitive whose `body(eqn)` takes exactly the equation's operands."""

    def rule(eqn, ins: list[int]) -> list[int]:
        jaxpr = body(eqn).jaxpr
        if len(jaxpr.invars) != len(ins):
            return _from_every_operand(eqn, ins)
        return _flow(jaxpr, ins)

    return rule


def _any_branch(eqn, ins: list[int]) -> list[int]:
    """`cond`: the index (an integer) carries nothing; each branch may be taken."""
    outs = [0] * len(eqn.outvars)
    for branch in jx.bodies(eqn):
        taken = _flow(branch, ins[1:])
        outs = [a | b for a, b in zip(outs, taken, strict=True)]
    return outs


_FLOW_RULES = {
    "stop_gradient": _cut,
    **dict.fromkeys(jx.CALLS, _through(jx.call_body)),
    "custom_vjp_call": _through(lambda eqn: jx.custom_call_body(eqn.params)),
    "shard_map": _through(lambda eqn: jx.shard_map_body(eqn.params)),
    "cond": _any_branch,
}


__all__ = ["contains", "dependence"]
