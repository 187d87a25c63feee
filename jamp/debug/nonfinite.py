"""`first_nonfinite`: the first equation of the real low-precision run whose result is inf or
NaN (`locate`, which also finds where the report's float32 shadow went non-finite)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import numpy as np

from jamp.debug import program as programs
from jamp.debug import shadow
from jamp.policy.dtypes import FLOAT32, is_floating, is_half_dtype
from jamp.walker import nonfinite


class _Codes(shadow.Probe):
    """The code (`jamp.walker.nonfinite`: NaN, inf) of an equation's floating results in the
    low run (or, `of_shadow`, in the float32 shadow), per scan iteration."""

    per_iteration = True

    def __init__(self, of_shadow: bool = False):
        self.of_shadow = of_shadow

    def wants(self, aval) -> bool:
        return is_floating(aval)

    def measure(self, sites, low, shadow_values):
        values = shadow_values if self.of_shadow else low
        return (nonfinite.code(values.reshape(values.shape[0], -1), axis=1),)

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

    @property
    def pass_name(self) -> str:
        return "backward" if self.backward else "forward"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["iterations"] = list(self.iterations)
        return out

    def __str__(self) -> str:
        where = f" (scan iteration {', '.join(map(str, self.iterations))})" \
            if self.iterations else ""
        return (f"first non-finite value ({self.value}, {self.dtype}): {self.primitive} in "
                f"{self.module}, {self.pass_name}{where}, at "
                f"{self.location}: {self.code}")


def first_nonfinite(fn: Callable, *args: Any, dtype: Any = None,
                    device_type: str | None = None, rules: Any = None,
                    loss_scale: float | None = None, argnums: Any = 0, backward: bool = True,
                    **kwargs: Any) -> NonFinite | None:
    """The first equation whose result holds an inf or a NaN when `fn` runs in half precision.

    `fn` runs as `precision_report` runs it (under autocast with `dtype`, `device_type` and
    `rules`, and for a scalar loss its backward pass at `loss_scale`), once, under `jax.jit`,
    without a shadow: the values are the real low-precision run's. Every equation's floating
    results (inside jit, scan, while, cond and remat bodies too) are checked; the first in
    program order (within loops, by iteration: an equation that only passed on a value made
    non-finite in an earlier iteration is not named) that holds an inf or a NaN is named.

    Args: as `precision_report`'s. Where `fn`'s backward pass cannot be built (a
      `lax.while_loop` in its forward pass), the forward pass alone is checked, with a warning
      saying so.

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
                          argnums=argnums, backward=backward)
    if made.note:
        warnings.warn(f"first_nonfinite: {made.note}", UserWarning, stacklevel=2)
    return locate(made)


def locate(made: programs.Program, of_shadow: bool = False) -> NonFinite | None:
    """The first equation of `made` whose result holds an inf or a NaN in its low run (or,
    `of_shadow`, in its float32 shadow), run once; None when there is none."""
    evaluator = shadow.Evaluator(_Codes(of_shadow), shadow=of_shadow)
    codes = evaluator.run_program(made.closed, made.args).probes
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
    location, code = programs.source(site.eqn)
    # The shadow holds float32 where the program holds a half dtype.
    dtype = FLOAT32 if of_shadow and is_half_dtype(site.dtype) else site.dtype
    return NonFinite(site.eqn.primitive.name, location, code,
                     "/".join(site.path) or programs.TOP_LEVEL, site.backward, dtype.name,
                     nonfinite.describe(kind), first)


def _order(key: tuple, scans: tuple, iterations: tuple) -> tuple:
    """The key with each scan's iteration after the scan's own index: execution order."""
    merged, start = [], 0
    for depth, i in zip(scans, iterations):
        merged += [*key[start:depth], i]
        start = depth
    return (*merged, *key[start:])


__all__ = ["first_nonfinite", "locate", "NonFinite"]
