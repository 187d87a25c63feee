"""The AMP report's count of a program: every equation, sub-programs included, by primitive
and Flax module, with the FLOPs of its matmuls and convolutions and the bytes of its operands
and results by dtype, as often as it runs.

How often each equation runs is the walk's (`jamp.walker.walk`: a scan's body per iteration,
a shard_map's per device, a while loop's once since its trip count is not in the program), and
so is whether the lowered program writes it where it stands (a jit body called from several
places is written once). One branch of a cond runs, which one is known only then: the
costliest is counted as run, the others as written only.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jamp.policy.dtypes import FLOAT8_E5M2, is_fp8_dtype
from jamp.policy.primitives import MATMULS
from jamp.profile import stablehlo_converts
from jamp.transforms.rules import equation_path
from jamp.walker.walk import Site, walk
from jamp import _jax_internals as jx

CONVERT = "convert_element_type"
# The primitives that keep a float8 value's grid while moving or rescaling it: a value cast
# back from float8 and divided by its scale (the emulated fp8 GEMM's operand, `jamp.fp8`'s
# dequantization) or laid out again (mxfp8's blocks) is still a float8 value, scaled.
_KEEPS_FP8 = frozenset({"mul", "div", "neg", "broadcast_in_dim", "reshape", "transpose",
                        "squeeze", "expand_dims", "pad", "slice", "rev", "copy", CONVERT})


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
    `("convert", source, target, module path)`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.profile.tally import Tally
      >>> tally = Tally()
      >>> tally.walk(jax.make_jaxpr(lambda x: jnp.sin(x) @ x)(jnp.ones((2, 2))).jaxpr, (), 1)
      >>> sorted(key[1] for key in tally.stats)
      ['dot_general', 'sin']
    """

    def __init__(self):
        self.stats: dict[tuple, Stats] = collections.defaultdict(Stats)
        # One equation per kind of lowering.
        self.examples: dict[Any, Any] = {}
        # The variables that hold float8 values (cast back and scaled, or still float8), with
        # their float8 dtype: a matmul of two of them is an fp8 GEMM.
        self.fp8: dict[Any, np.dtype] = {}

    def walk(self, jaxpr, path: tuple[str, ...] = (), times: int = 1) -> None:
        """Counts the equations of the open jaxpr `jaxpr`, run `times` times inside the
        modules `path`."""
        sites = list(walk(jaxpr))
        taken = _taken(sites)
        modules: dict[tuple, tuple[str, ...]] = {(): tuple(path)}
        for site, runs in zip(sites, taken, strict=True):
            eqn = site.eqn
            name = eqn.primitive.name
            here = equation_path(eqn, _module_path(site.path, modules))
            count = times * site.times * runs
            if jx.bodies(eqn):  # a higher-order equation: its work is its bodies'
                own = self.stats[("eqn", name, here, None)]
            elif name == CONVERT:
                own = self.stats[("eqn", name, here, None)]
                self._note_convert(eqn, here, count, site.written)
            else:
                lowering = stablehlo_converts.lowering_key(eqn)
                self.examples.setdefault(lowering, eqn)
                own = self.stats[("eqn", name, here, lowering)]
            own.static += site.written
            own.count += count
            flops = _matmul_flops(eqn)
            if flops:
                own.flops[self._compute_dtype(eqn)] += flops * count
            self._follow_fp8(eqn)
            for dtype, n in _bytes_by_dtype(eqn).items():
                own.bytes[dtype] += n * count

    def _follow_fp8(self, eqn) -> None:
        """Notes the float8 values `eqn` makes: a float8 result, or a float8 operand's value
        moved or scaled (`_KEEPS_FP8`; a divisor's grid is not the quotient's)."""
        out = eqn.outvars[0] if len(eqn.outvars) == 1 else None
        if out is None or not hasattr(out.aval, "dtype"):
            return
        if is_fp8_dtype(out.aval.dtype):
            self.fp8[out] = np.dtype(out.aval.dtype)
        elif eqn.primitive.name in _KEEPS_FP8:
            carriers = eqn.invars[:1] if eqn.primitive.name == "div" else eqn.invars
            found = [self.fp8[a] for a in carriers if self._is_fp8(a)]
            if found:
                self.fp8[out] = found[0]

    def _is_fp8(self, atom) -> bool:
        return not isinstance(atom, jx.Literal) and atom in self.fp8

    def _compute_dtype(self, eqn) -> str:
        """The dtype a matmul computes in: its operands' (promoted, if they differ); for an
        fp8 GEMM, emulated or not, their float8 dtype (e5m2 where e4m3 meets e5m2: the
        coarser grid)."""
        lhs, rhs = eqn.invars[:2]
        if all(self._is_fp8(a) or is_fp8_dtype(a.aval.dtype) for a in (lhs, rhs)):
            found = {self.fp8.get(a, np.dtype(a.aval.dtype)) for a in (lhs, rhs)}
            return str(found.pop() if len(found) == 1 else FLOAT8_E5M2)
        return str(jnp.promote_types(lhs.aval.dtype, rhs.aval.dtype))

    def _note_convert(self, eqn, path: tuple[str, ...], count: int, written: bool) -> None:
        # A weak-type change (float32 -> float32) is a convert of the lowered program too,
        # one XLA removes: counted, so that the count is the program's.
        source, target = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
        stats = self.stats[("convert", str(source), str(target), path)]
        stats.static += written
        stats.count += count
        stats.bytes[str(target)] += _array_bytes(eqn.outvars[0].aval)[1] * count


def _module_path(path: tuple, modules: dict[tuple, tuple[str, ...]]) -> tuple[str, ...]:
    """The module path of the equations inside the higher-order equations `path` (name stacks
    inside a body are relative to its equation's), remembered per `path`."""
    if path not in modules:
        outer = _module_path(path[:-1], modules)
        modules[path] = equation_path(path[-1].eqn, outer)
    return modules[path]


def _taken(sites: list[Site]) -> list[int]:
    """For each site, 1 when it runs as often as the walk says, 0 when it is in a cond branch
    that is not counted as run: of a cond's branches, the costliest (executed FLOPs, then
    bytes) is; inner conds are decided first, so a branch's cost is what it runs."""
    taken = [1] * len(sites)
    # Each cond where the walk meets it (the same cond may sit in a jit body called twice):
    # (the path to it, the cond), and the sites of each of its branches.
    branches: dict[tuple[tuple, Any], dict[int, list[int]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    for i, site in enumerate(sites):
        for depth, around in enumerate(site.path):
            if around.eqn.primitive.name == "cond":
                branches[(site.path[:depth], around.eqn)][around.body].append(i)
    for where in sorted(branches, key=lambda where: len(where[0]), reverse=True):
        sizes = len(jx.bodies(where[1]))

        def cost(branch: int, where=where) -> tuple[int, int]:
            flops = bytes_ = 0
            for i in branches[where].get(branch, ()):
                runs = sites[i].times * taken[i]
                flops += _matmul_flops(sites[i].eqn) * runs
                bytes_ += _counted_bytes(sites[i].eqn) * runs
            return flops, bytes_

        costliest = max(range(sizes), key=cost)
        for branch, members in branches[where].items():
            if branch != costliest:
                for i in members:
                    taken[i] = 0
    return taken


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
    if name == "ragged_dot_general":
        # Each output element sums k products, as a dot_general's; where the ragged dimension
        # is contracted, the result has one slice per group and each group sums its own
        # segment of k: the groups together sum k products per element of one slice.
        numbers = eqn.params["ragged_dot_dimension_numbers"]
        (lhs_contract, _), _ = numbers.dot_dimension_numbers
        flops = 2 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract)
        if set(numbers.lhs_ragged_dimensions) & set(lhs_contract):
            flops //= eqn.invars[2].aval.shape[-1]
        return flops
    # Each output element sums a kernel window of products over the kernel's input features,
    # which are one group's input features (feature_group_count already divided them).
    rhs_spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, window)
    window = math.prod(rhs[d] for d in rhs_spec[2:])
    return 2 * math.prod(out) * window * rhs[rhs_spec[1]]


def _bytes_by_dtype(eqn) -> collections.Counter:
    """The bytes of a first-order equation's operands and results, by dtype; none for a
    higher-order equation (its work is its bodies')."""
    found: collections.Counter = collections.Counter()
    if jx.bodies(eqn):
        return found
    for atom in (*eqn.invars, *eqn.outvars):
        dtype, size = _array_bytes(atom.aval)
        if size:
            found[dtype] += size
    return found


def _counted_bytes(eqn) -> int:
    """The bytes one run of an equation adds to a tally: its operands' and results', and a
    convert's result once more, as the cast's."""
    extra = _array_bytes(eqn.outvars[0].aval)[1] if eqn.primitive.name == CONVERT else 0
    return sum(_bytes_by_dtype(eqn).values()) + extra


def _array_bytes(aval) -> tuple[str, int]:
    """(dtype name, bytes) of an array's abstract value; ("", 0) for tokens and the like."""
    dtype, shape = getattr(aval, "dtype", None), getattr(aval, "shape", None)
    if dtype is None or shape is None:
        return "", 0
    return str(dtype), math.prod(shape) * getattr(dtype, "itemsize", 0)


__all__ = ["CONVERT", "MATMULS", "Stats", "Tally"]
