"""`first_nonfinite`: the first equation of the real low-precision run whose result is inf or
NaN."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from jamp.debug import program as programs
from jamp.debug import shadow
from jamp.debug.report import TOP_LEVEL, source
from jamp.policy.dtypes import is_floating
from jamp.walker import nonfinite


class _Codes(shadow.Probe):
    """The code (`jamp.walker.nonfinite`: NaN, inf) of an equation's floating results, per
    scan iteration."""

    per_iteration = True

    def wants(self, aval) -> bool:
        return is_floating(aval)

    def measure(self, sites, low, shadow_values):
        return (nonfinite.code(low.reshape(low.shape[0], -1), axis=1),)

    def combine(self, a, b):
        return (a[0] | b[0],)

    def over_while(self, so_far, new):
        # The codes of the first iteration that made a non-finite value, as anomaly mode
        # keeps them: in later ones it spreads to equations that only read it.
        kept = nonfinite.keep_first({k: v[0] for k, v in so_far.items()},
                                    {k: v[0] for k, v in new.items()})
        return {k: (code,) for k, code in kept.items()}


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """The first equation whose result held an inf or a NaN.

    Attributes:
      primitive: the JAX primitive.
      location: the source `file:line` that made it (for a backward equation, the forward
        line it differentiates).
      code: that line's text.
      module: its module path, or "(top level)".
      backward: it belongs to the backward pass.
      dtype: the dtype of its results.
      value: "inf", "nan" or "inf and nan".
      iterations: for an equation inside scans, the first iteration (per scan, outermost
        first) where it happened; () otherwise.
    """

    primitive: str
    location: str
    code: str
    module: str
    backward: bool
    dtype: str
    value: str
    iterations: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["iterations"] = list(self.iterations)
        return out

    def __str__(self) -> str:
        where = f" (scan iteration {', '.join(map(str, self.iterations))})" \
            if self.iterations else ""
        return (f"first non-finite value ({self.value}, {self.dtype}): {self.primitive} in "
                f"{self.module}, {'backward' if self.backward else 'forward'}{where}, at "
                f"{self.location}: {self.code}")


def first_nonfinite(fn: Callable, *args: Any, dtype: Any = None,
                    device_type: str | None = None, rules: Any = None,
                    loss_scale: float | None = None, argnums: Any = 0,
                    **kwargs: Any) -> NonFinite | None:
    """The first equation whose result holds an inf or a NaN when `fn` runs in half precision.

    `fn` runs as `precision_report` runs it (under autocast with `dtype`, `device_type` and
    `rules`, and for a scalar loss its backward pass at `loss_scale`), once, under `jax.jit`,
    without a shadow: the values are the real low-precision run's. Every equation's floating
    results (inside jit, scan, while, cond and remat bodies too) are checked; the first in
    program order (within scans, by iteration) that holds an inf or a NaN is named.

    Args: as `precision_report`'s.

    Returns:
      A `NonFinite` naming the equation, or None when every value is finite.

    Raises:
      as `precision_report`.

    Example:
      >>> import jax.numpy as jnp
      >>> from jamp.debug import first_nonfinite
      >>> def f(x):
      ...     return jnp.sum(jnp.log(x - 1.0))   # log(0) for x == 1
      >>> first_nonfinite(f, jnp.array([1.0, 2.0]), dtype=jnp.float16).primitive
      'log'
      >>> first_nonfinite(f, jnp.array([3.0, 2.0]), dtype=jnp.float16) is None
      True
    """
    made = programs.build(fn, args, kwargs, caller="first_nonfinite", dtype=dtype,
                          device_type=device_type, rules=rules, loss_scale=loss_scale,
                          argnums=argnums)
    evaluator = shadow.Evaluator(_Codes(), shadow=False)
    codes = evaluator.run_program(made.closed, made.args)[2]
    found = []
    for key, (site_codes,) in codes.items():
        site = evaluator.sites[key]
        site_codes = np.asarray(site_codes)
        hits = np.argwhere(site_codes)
        if not len(hits):
            continue
        first = tuple(int(i) for i in hits[0])
        found.append((_order(key, site.scans, first), site, first, site_codes[first]))
    if not found:
        return None
    _, site, first, kind = min(found, key=lambda f: f[0])
    location, code = source(site.eqn)
    return NonFinite(site.eqn.primitive.name, location, code, "/".join(site.path) or TOP_LEVEL,
                     site.backward, site.dtype.name, nonfinite.describe(kind), first)


def _order(key: tuple, scans: tuple, iterations: tuple) -> tuple:
    """The key with each scan's iteration after the scan's own index: execution order."""
    merged, start = [], 0
    for depth, i in zip(scans, iterations):
        merged += [*key[start:depth], i]
        start = depth
    return (*merged, *key[start:])


__all__ = ["first_nonfinite", "NonFinite"]
