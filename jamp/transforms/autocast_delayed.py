"""The delayed fp8 recipe in autocast: the state of each product it selects, threaded into the
program as inputs and routed to the product through the bodies around it.

A *site* is one product a delayed recipe selects, at one place of the user's traced program.
Its *address* is the equation indices from the top jaxpr down to it (a body's equations under
the index of the equation that holds the body): the same in every trace of one program, and
distinct for two calls of one helper. Its *key*, under which the user's state holds it, is
its module path (see `jamp.fp8.autocast_state`).

A program with delayed sites is built in two passes (`programs.Program.build`):

- discovery (`Sites()`): the program is traced once with a fresh state made at each site,
  recording its path, recipe and the lengths of the scans around it (its state's leading
  axes);
- the program itself (`Sites.running`): the states are its extra inputs, by address. A scan
  slices the states of its body's sites per iteration (as extra xs); a `jit` body with sites
  is inlined (the states pass by address); a remat body closes over them (`jax.checkpoint`
  makes closed-over values its inputs).

Refused, with an error naming the module: a site in a `while_loop` body (run a
data-dependent number of times, its state has no axis to stack on), a `cond` branch (a branch
not taken would give its sites a zero state as their gradient), a `custom_jvp` or
`custom_vjp` function (the user's derivative rule, not the product's, makes the gradient, so
no new state would come back), or a `shard_map` body.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_internals as jx
from jamp.fp8.delayed_scaling import DelayedState, init_delayed_state
from jamp.fp8.recipes import Recipe
from jamp.transforms import rules as precision_rules

Address = tuple[int, ...]
# The key of a product outside every module.
TOP_LEVEL = "(top level)"


@dataclasses.dataclass(frozen=True)
class Site:
    """One delayed product of a program.

    Attributes:
      address: where it sits (see the module docstring).
      path: its module path.
      stack: the lengths of the scans around it, outermost first (its state's leading axes).
      recipe: its delayed recipe (the history length).
    """

    address: Address
    path: tuple[str, ...]
    stack: tuple[int, ...]
    recipe: Recipe

    @functools.cached_property
    def shapes(self) -> list[jax.ShapeDtypeStruct]:
        """The shapes and dtypes of its state's fields, stacked along `stack`."""
        fresh = jax.eval_shape(lambda: init_delayed_state(self.recipe))
        return [jax.ShapeDtypeStruct(self.stack + leaf.shape, leaf.dtype) for leaf in fresh]

    def initial(self) -> DelayedState:
        """A fresh state, stacked along `stack`."""
        fresh = init_delayed_state(self.recipe)
        return DelayedState(*(jnp.zeros(self.stack + leaf.shape, leaf.dtype) + leaf
                              for leaf in fresh))


@dataclasses.dataclass(frozen=True)
class Where:
    """Where the jaxpr being evaluated sits: its address, the module names and scan lengths
    around it, the primitive that refuses delayed sites in it (or None) and the states of the
    sites in it (by address; empty while discovering)."""

    address: Address = ()
    names: tuple[str, ...] = ()
    stack: tuple[int, ...] = ()
    refused: str | None = None
    states: Mapping[Address, DelayedState] = dataclasses.field(default_factory=dict,
                                                                compare=False)

    def key(self) -> tuple:
        """What a body transformed here depends on (part of its cache key)."""
        return (self.address, self.names, self.stack, self.refused)

    def under(self) -> dict[Address, DelayedState]:
        """The states of the sites in this jaxpr or the bodies inside it."""
        depth = len(self.address)
        return {a: s for a, s in self.states.items() if a[:depth] == self.address}


class Sites:
    """The delayed sites of one autocast program while it is traced (`Context.delayed`):
    discovering them, or running with their states."""

    def __init__(self, states: Mapping[Address, DelayedState] | None = None):
        self.discovering = states is None
        self.where = Where(states={} if states is None else dict(states))
        self.found: dict[Address, Site] = {}

    @classmethod
    def running(cls, sites: Sequence[Site], leaves: Sequence[Any]) -> "Sites":
        """The program's sites with their states, from the program's extra inputs (`leaves`,
        six per site in `sites`' order)."""
        return cls(_by_address([site.address for site in sites], leaves))

    def sites(self) -> tuple[Site, ...]:
        """The sites discovered, in program order."""
        return tuple(self.found[a] for a in sorted(self.found))

    @contextlib.contextmanager
    def inside(self, where: Where) -> Iterator[None]:
        """Evaluates the jaxprs made inside at `where`."""
        outer, self.where = self.where, where
        try:
            yield
        finally:
            self.where = outer

    def body(self, where: Where, index: int, eqn, refused: str | None = None,
             length: int | None = None) -> Where:
        """Where the bodies of equation `index` of a jaxpr at `where` sit: `refused` names
        a primitive whose bodies cannot hold delayed sites, `length` a scan's."""
        return dataclasses.replace(
            where, address=where.address + (index,),
            names=where.names + tuple(jx.scope_names(eqn)),
            stack=where.stack + (() if length is None else (length,)),
            refused=where.refused or refused)

    def key(self) -> tuple | None:
        """What a body transformed here depends on (part of its cache key): its place, while
        discovering or where it holds sites; elsewhere nothing, so that the calls of a
        function without sites share one transformed body."""
        return self.where.key() if self.has_sites(self.where) else None

    def has_sites(self, where: Where) -> bool:
        """Whether the bodies at `where` may hold sites (always, while discovering)."""
        return self.discovering or bool(where.under())

    def state(self, where: Where, index: int, eqn, recipe: Recipe) -> DelayedState:
        """The state of the delayed product, equation `index` of a jaxpr at `where`."""
        path = precision_rules.module_path((), (*where.names, *jx.scope_names(eqn)))
        if where.refused is not None:
            raise ValueError(
                f"fp8 layer {_key(path)!r}: its product runs the delayed recipe inside a "
                f"{where.refused} body, where autocast cannot thread its state (docs/fp8.md, "
                "\"Delayed scaling\"). Give that module a current-scaling recipe "
                "(jamp.fp8.recipe(\"tensorwise\")) with a rule before the delayed one.")
        address = where.address + (index,)
        if self.discovering:
            site = Site(address, path, where.stack, recipe)
            self.found[address] = site
            return init_delayed_state(recipe)
        if address not in where.states:
            # A product traced only when JAX differentiates (a custom_bwd's): the sites
            # were found in the forward program.
            raise ValueError(f"fp8 layer {_key(path)!r}: its product runs the delayed recipe "
                             "where autocast found no site for it (a custom derivative "
                             "rule's backward): give it a current-scaling recipe.")
        return where.states[address]

    def sliced(self, where: Where, leaves: Sequence[Any]) -> Where:
        """`where` (a scan body's) with the states of its sites, one iteration's slices
        (`leaves`, six per site, in address order: as `stacked` gives them)."""
        return dataclasses.replace(where, states=_by_address(sorted(where.under()), leaves))


def _by_address(addresses: Sequence[Address], leaves: Sequence[Any]
                ) -> dict[Address, DelayedState]:
    """The states whose leaves are `leaves`, six per address, in the order of `addresses`."""
    width = len(DelayedState._fields)
    return {a: DelayedState(*leaves[i * width:(i + 1) * width])
            for i, a in enumerate(addresses)}


def stacked(where: Where) -> list[Any]:
    """The leaves of the states of the sites in the body at `where` (a scan's), in address
    order: the scan's extra xs."""
    under = where.under()
    return [leaf for a in sorted(under) for leaf in under[a]]


def _key(path: Sequence[str]) -> str:
    return "/".join(path) or TOP_LEVEL


def keys(sites: Sequence[Site]) -> list[str]:
    """The key of each site in the user's state: its module path, with ":k" where a module
    runs several products (k counts them in program order)."""
    paths = [_key(site.path) for site in sites]
    seen: dict[str, int] = {}
    result = []
    for path in paths:
        k = seen[path] = seen.get(path, -1) + 1
        result.append(f"{path}:{k}" if paths.count(path) > 1 else path)
    return result


def initial_state(sites: Sequence[Site]) -> dict[str, DelayedState]:
    """Fresh states of `sites`, by key."""
    return {key: site.initial() for key, site in zip(keys(sites), sites, strict=True)}


def state_leaves(sites: Sequence[Site], state: Any) -> list[Any]:
    """The leaves of the user's `state` in the order of `sites` (the program's extra inputs).

    Raises:
      ValueError: `state` is not a dict of the sites' keys (naming the missing and the extra
        ones), or a site's state has other shapes than its recipe and scans give it.
    """
    expected = dict(zip(keys(sites), sites, strict=True))
    if not isinstance(state, Mapping):
        raise ValueError(f"the fp8 delayed state is a dict from module path to "
                         f"jamp.fp8.DelayedState (from jamp.fp8.init_autocast_state); got "
                         f"{type(state).__name__}.")
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected]
    if missing or extra:
        problems = ([f"it lacks {', '.join(map(repr, missing))}"] if missing else []) + \
            ([f"it has {', '.join(map(repr, extra))}, which the function does not run"]
             if extra else [])
        raise ValueError(
            f"This fp8 delayed state does not fit the function: {'; '.join(problems)}. The "
            f"function's delayed products are {', '.join(map(repr, expected)) or 'none'}: "
            "make its state with jamp.fp8.init_autocast_state(fn, *args).")
    leaves: list[Any] = []
    for key, site in expected.items():
        value = state[key]
        want = [w.shape for w in site.shapes]
        if not isinstance(value, DelayedState) or [np.shape(v) for v in value] != want:
            got = ([np.shape(v) for v in value] if isinstance(value, DelayedState)
                   else type(value).__name__)
            raise ValueError(
                f"The fp8 delayed state of {key!r} does not fit {site.recipe!r} "
                f"{'in scans of lengths ' + str(site.stack) + ' ' if site.stack else ''}"
                f"there: its shapes are {got}, expected {want}.")
        leaves.extend(value)
    return leaves


def state_avals(sites: Sequence[Site]) -> list[Any]:
    """The avals of the program's extra inputs."""
    return [leaf for site in sites for leaf in site.shapes]


__all__ = ["Address", "initial_state", "keys", "Site", "Sites", "stacked", "state_avals",
           "state_leaves", "TOP_LEVEL", "Where"]
