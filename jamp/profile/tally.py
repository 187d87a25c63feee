"""The AMP report's count of a program: every equation, sub-programs included, by primitive
and Flax module, with the FLOPs of its matmuls and convolutions and the bytes of its operands
and results by dtype, as often as it runs.

First-order equations are counted where they stand. A higher-order equation's work is its
bodies', and how often each body runs is the primitive's: a rule per primitive
(`_BODY_RULES`) combines the counts of its bodies, as the autocast interpreter rewrites each
primitive by a rule. Every other higher-order primitive runs each body once per run of the
equation (a while loop's trip count is not in the program: its bodies count once).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Callable

import jax.numpy as jnp

from jamp.profile import stablehlo_converts
from jamp.transforms.rules import equation_path
from jamp import _jax_internals as jx

# The primitives whose FLOPs the report counts (as torch's profiler `with_flops` does).
MATMULS = ("dot_general", "conv_general_dilated")
CONVERT = "convert_element_type"


@dataclasses.dataclass
class Stats:
    """Equations counted together: in the program text (`static`) and executed (`count`),
    with matmul FLOPs by compute dtype and operand and result bytes by dtype, executed."""

    static: int = 0
    count: int = 0
    flops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, other: "Stats", times: int = 1, static: bool = True) -> None:
        self.static += other.static if static else 0
        self.count += other.count * times
        for mine, theirs in ((self.flops, other.flops), (self.bytes, other.bytes)):
            for dtype, n in theirs.items():
                mine[dtype] += n * times


class Tally:
    """The statistics of a program, keyed by `("eqn", primitive, module path, lowering)`
    (`lowering` names a first-order equation's lowering, None for others) and, for casts,
    `("convert", source, target, module path)`. A sub-program is counted into a tally of its
    own, then added in as often as it runs.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.profile.tally import Tally
      >>> tally = Tally()
      >>> tally.walk(jax.make_jaxpr(lambda x: jnp.sin(x) @ x)(jnp.ones((2, 2))).jaxpr, (), 1)
      >>> sorted(key[1] for key in tally.stats)
      ['dot_general', 'sin']
    """

    def __init__(self, parent: "Tally | None" = None):
        self.stats: dict[tuple, Stats] = collections.defaultdict(Stats)
        # Shared by a program and its sub-programs: one equation per kind of lowering, and
        # the jit bodies already counted statically (jax lowers a jit body called from
        # several places to one function).
        self.examples: dict[Any, Any] = {} if parent is None else parent.examples
        self.written_jits: dict[int, Any] = {} if parent is None else parent.written_jits

    def add(self, other: "Tally", times: int, static: bool = True) -> None:
        for key, stats in other.stats.items():
            self.stats[key].add(stats, times, static)

    def cost(self) -> tuple[int, int]:
        """Executed (FLOPs, bytes): what picks a cond's most expensive branch."""
        flops = sum(sum(s.flops.values()) for s in self.stats.values())
        return flops, sum(sum(s.bytes.values()) for s in self.stats.values())

    def walk(self, jaxpr, path: tuple[str, ...], times: int) -> None:
        """Counts the equations of the open jaxpr `jaxpr`, run `times` times inside the
        modules `path`."""
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            here = equation_path(eqn, path)
            bodies = jx.bodies(eqn)
            if bodies:  # a higher-order equation: its work is its bodies'
                own = self.stats[("eqn", name, here, None)]
                _BODY_RULES.get(name, _each_body)(self, eqn, bodies, here, times)
            elif name == CONVERT:
                own = self.stats[("eqn", name, here, None)]
                self._note_convert(eqn, here, times)
            else:
                lowering = stablehlo_converts.lowering_key(eqn)
                self.examples.setdefault(lowering, eqn)
                own = self.stats[("eqn", name, here, lowering)]
            own.static += 1
            own.count += times
            if not bodies:
                flops = _matmul_flops(eqn)
                if flops:
                    own.flops[_compute_dtype(eqn)] += flops * times
                for atom in (*eqn.invars, *eqn.outvars):
                    dtype, size = _array_bytes(atom.aval)
                    if size:
                        own.bytes[dtype] += size * times

    def sub(self, body, path: tuple[str, ...]) -> "Tally":
        """The tally of one run of the open jaxpr `body`."""
        sub = Tally(self)
        sub.walk(body, path, 1)
        return sub

    def _note_convert(self, eqn, path: tuple[str, ...], times: int) -> None:
        # A weak-type change (float32 -> float32) is a convert of the lowered program too,
        # one XLA removes: counted, so that the count is the program's.
        source, target = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
        stats = self.stats[("convert", str(source), str(target), path)]
        stats.static += 1
        stats.count += times
        stats.bytes[str(target)] += _array_bytes(eqn.outvars[0].aval)[1] * times


# -- the rules: how often each body of a higher-order equation runs -------------------------

_BodyRule = Callable[[Tally, Any, list, tuple, int], None]


def _each_body(tally: Tally, eqn, bodies: list, path: tuple[str, ...], times: int) -> None:
    """Each body runs once per run of the equation."""
    for body in bodies:
        tally.add(tally.sub(body, path), times)


def _costliest_branch(tally: Tally, eqn, bodies: list, path: tuple[str, ...],
                      times: int) -> None:
    """`cond`: one branch runs, which one is known only then: the costliest is counted as
    run, the others as written only."""
    branches = [tally.sub(body, path) for body in bodies]
    costliest = max(branches, key=Tally.cost)
    for branch in branches:
        tally.add(branch, times if branch is costliest else 0)


def _per_iteration(tally: Tally, eqn, bodies: list, path: tuple[str, ...], times: int) -> None:
    """`scan`: the body runs once per iteration."""
    _each_body(tally, eqn, bodies, path, times * eqn.params["length"])


def _per_device(tally: Tally, eqn, bodies: list, path: tuple[str, ...], times: int) -> None:
    """`shard_map`: the body is one device's share, and runs on each device of its manual
    mesh axes."""
    options = jx.shard_map_options(eqn.params)
    sizes = dict(options["mesh"].shape)
    devices = math.prod(sizes[a] for a in options.get("axis_names", sizes))
    _each_body(tally, eqn, bodies, path, times * devices)


def _written_once(tally: Tally, eqn, bodies: list, path: tuple[str, ...], times: int) -> None:
    """`jit`: jax lowers a jit body called from several places to one function of the
    lowered program, so the body is counted in the program text once, unless jax copies it
    into each caller (`jax.jit(inline=True)` bodies from jax 0.11)."""
    body = jx.call_body(eqn)
    if jx.jit_inlined_when_lowered(eqn.params):
        tally.add(tally.sub(body.jaxpr, path), times)
        return
    written = id(body) in tally.written_jits
    tally.written_jits[id(body)] = body  # kept alive: its id stays its own
    tally.add(tally.sub(body.jaxpr, path), times, static=not written)


_BODY_RULES: dict[str, _BodyRule] = {
    "cond": _costliest_branch,
    "scan": _per_iteration,
    "shard_map": _per_device,
    "jit": _written_once,
}


# -- one first-order equation ---------------------------------------------------------------

def _matmul_flops(eqn) -> int:
    """2 * the multiply-adds of a matmul or convolution; 0 for every other primitive."""
    name = eqn.primitive.name
    if name not in MATMULS:
        return 0
    lhs, rhs = (a.aval.shape for a in eqn.invars[:2])
    out = eqn.outvars[0].aval.shape
    if name == "dot_general":
        # Each output element (batch x m x n of them) sums k products.
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        return 2 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract)
    # Each output element sums a kernel window of products over the kernel's input features,
    # which are one group's input features (feature_group_count already divided them).
    rhs_spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, window)
    window = math.prod(rhs[d] for d in rhs_spec[2:])
    return 2 * math.prod(out) * window * rhs[rhs_spec[1]]


def _compute_dtype(eqn) -> str:
    """The dtype a matmul computes in: its operands' (promoted, if they differ)."""
    lhs, rhs = (a.aval.dtype for a in eqn.invars[:2])
    return str(jnp.promote_types(lhs, rhs))


def _array_bytes(aval) -> tuple[str, int]:
    """(dtype name, bytes) of an array's abstract value; ("", 0) for tokens and the like."""
    dtype, shape = getattr(aval, "dtype", None), getattr(aval, "shape", None)
    if dtype is None or shape is None:
        return "", 0
    return str(dtype), math.prod(shape) * getattr(dtype, "itemsize", 0)


__all__ = ["CONVERT", "MATMULS", "Stats", "Tally"]
