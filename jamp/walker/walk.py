"""The one walk over a program for the analyses that read it without running it: the AMP
report's tally, `primitive_names`, `jamp.autograd.dependence`'s `contains`.

`walk(jaxpr)` yields every equation, those of the bodies nested in it included, each with the
equations around it (`Site.path`) and how many times it runs per run of the program
(`Site.times`). How often a body runs is its primitive's:

- `scan`: once per iteration (its `length`);
- `shard_map`: on each device of its manual mesh axes (the body is one device's share);
- `cond`: one branch runs, and which one is known only when it does: each branch counts as
  run as often as the cond, and an analysis that needs one branch picks it from
  `Enclosing.body` (the tally counts the costliest);
- `while`: the trip count is not in the program: condition and body count once;
- every other primitive (`jit`, remat, custom_jvp/custom_vjp): once per run of the equation.

A `jit` body called from several places is one function of the lowered program: `Site.written`
says whether an equation is written in the program text where the walk meets it.

It imports nothing of jamp but `_jax_internals`, so `jamp.policy` may use it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator, NamedTuple, cast

from jamp import _jax_internals as jx

__all__ = ["Enclosing", "Site", "equations", "walk"]


class Enclosing(NamedTuple):
    """A higher-order equation around a site, and which of its bodies (`jx.bodies` order:
    a cond's branch index, a while's condition 0 and body 1) the site is in."""

    eqn: jx.JaxprEqn
    body: int


@dataclasses.dataclass(frozen=True)
class Site:
    """One equation where the walk meets it.

    Attributes:
      eqn: the equation.
      path: the higher-order equations around it, outermost first (empty at the top).
      times: how many times it runs per run of the top program (see the module docstring for
        cond and while).
      written: False inside a `jit` body that the lowered program already holds from an
        earlier call (jax lowers such a body to one function for all its callers).
    """

    eqn: jx.JaxprEqn
    path: tuple[Enclosing, ...]
    times: int
    written: bool


def walk(jaxpr: jx.Jaxpr | jx.ClosedJaxpr) -> Iterator[Site]:
    """Every equation of `jaxpr` and of its bodies, depth first: each equation, then those of
    its bodies in order.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.walker.walk import walk
      >>> def f(x):
      ...     return jax.lax.scan(lambda c, _: (jnp.sin(c), None), x, length=3)[0]
      >>> [(s.eqn.primitive.name, s.times) for s in walk(jax.make_jaxpr(f)(1.0))]
      [('scan', 1), ('sin', 3)]
    """
    # The jit bodies met so far, kept alive so that their ids stay theirs.
    written: dict[int, jx.ClosedJaxpr] = {}
    top = cast(jx.Jaxpr, getattr(jaxpr, "jaxpr", jaxpr))
    yield from _walk(top, (), 1, True, written)


def equations(jaxpr: jx.Jaxpr | jx.ClosedJaxpr) -> Iterator[jx.JaxprEqn]:
    """The equations `walk` meets, in its order."""
    return (site.eqn for site in walk(jaxpr))


def _walk(jaxpr: jx.Jaxpr, path: tuple[Enclosing, ...], times: int, written: bool,
          jits: dict[int, jx.ClosedJaxpr]) -> Iterator[Site]:
    for eqn in jaxpr.eqns:
        yield Site(eqn, path, times, written)
        bodies = jx.bodies(eqn)
        if not bodies:
            continue
        inner = times * _RUNS.get(eqn.primitive.name, _once)(eqn)
        body_written = written and _written_here(eqn, jits)
        for index, body in enumerate(bodies):
            yield from _walk(body, (*path, Enclosing(eqn, index)), inner, body_written, jits)


def _written_here(eqn: jx.JaxprEqn, jits: dict[int, jx.ClosedJaxpr]) -> bool:
    """Whether a higher-order equation's bodies are written where it stands: a `jit` body
    already met is not, unless jax copies it into each caller (`jax.jit(inline=True)` from
    jax 0.11)."""
    if eqn.primitive.name != "jit" or jx.jit_inlined_when_lowered(eqn.params):
        return True
    body = jx.call_body(eqn)
    if id(body) in jits:
        return False
    jits[id(body)] = body
    return True


# -- how many times a body runs per run of its equation -------------------------------------

def _once(eqn: jx.JaxprEqn) -> int:
    return 1


def _iterations(eqn: jx.JaxprEqn) -> int:
    return eqn.params["length"]


def _devices(eqn: jx.JaxprEqn) -> int:
    options = jx.shard_map_options(eqn.params)
    sizes = dict(options["mesh"].shape)
    return math.prod(sizes[a] for a in options.get("axis_names", sizes))


_RUNS: dict[str, Callable[[jx.JaxprEqn], int]] = {
    "scan": _iterations,
    "shard_map": _devices,
}
