"""The debugger's evaluator: a program run equation by equation, with a float32 shadow.

`Evaluator` walks a closed jaxpr (the program autocast made, with its backward pass) while it is
traced into one `jax.jit` program, as an interpreter of `jamp.walker` whose values are
(low, shadow) pairs. Every equation is bound twice: on the program's own values
(the low run, float16 or bfloat16 where autocast put them) and, in the shadow, on float32
values: the same equation with each half dtype of its operands and params widened to float32.
The half values each equation returns are measured by a `Probe`, which reduces them to a few
numbers (largest magnitude, counts of tiny values...) that leave the program as extra outputs.
The values of equations of one shape and dtype are stacked and measured together, once per
body: one reduction per shape rather than one per equation keeps the program small to compile. The
shadow is what an ideal float32 run of the same program computes, so whether a value fits the
half dtype is read from it, whatever XLA keeps in registers in the low run.

Bodies are walked, each equation of them a site of its own:

- calls (`jit`, `closed_call`, `remat`, `custom_jvp_call`, `custom_vjp_call`) are inlined: only
  their values are needed here, and the program is never differentiated again, so a custom
  derivative rule (which only differentiation reads) changes nothing.

Loops and branches are rebuilt around their bodies by `jamp.walker.control_flow`:

- `scan`: the body runs in a `lax.scan` that carries both runs; its probes come out per
  iteration and are combined over iterations (maxima, sums) or kept per iteration
  (`Probe.per_iteration`);
- `while`: both runs are carried; probes are combined in the carry (`Probe.over_while`); the
  loop stops when the low run's condition says so;
- `cond`: the branch the low run takes runs in both; the other branches' probes read as
  neutral.

Every other higher-order primitive (`shard_map`, ...) runs whole in both runs, in the low
run's dtypes, and is not looked inside.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp import _jax_internals as jx
from jamp.policy import primitives
from jamp.policy.dtypes import FLOAT32, is_half, is_half_dtype, is_inexact
from jamp.transforms.rules import equation_path
from jamp.walker import control_flow, nonfinite
from jamp.walker.evaluate import Body, Env, Interpreter, literal_value

__all__ = ["Evaluator", "Probe", "Run", "Site", "run_once"]

# Moves carry values already probed where they were made (a convert is a rounding: probed).
_UNPROBED = primitives.MOVES - {"convert_element_type"}


@dataclasses.dataclass(frozen=True)
class Site:
    """One probed equation of the program.

    Attributes:
      key: its position: the indices of the equations around it and its own, outermost first
        (sorting keys gives program order).
      eqn: the equation.
      path: its module path (see `jamp.transforms.rules.equation_path`).
      backward: it belongs to the backward pass.
      dtype: the dtype of its (first probed) result.
      scans: for each scan body it sits in, outermost first, the length of the scan
        equation's key (per-iteration probes have one leading axis per scan).
    """

    key: tuple[int, ...]
    eqn: Any
    path: tuple[str, ...]
    backward: bool
    dtype: np.dtype
    scans: tuple[int, ...]


class Run(NamedTuple):
    """What `Evaluator.run_program` fetches from a run.

    Attributes:
      low: the program's first output in the low run (None without outputs).
      shadow: the same in the shadow.
      probes: each site's probes, by site key (`Evaluator.by_site`).
      shadow_code: the `jamp.walker.nonfinite` code of the shadow's outputs, all of them:
        nonzero when one holds an inf or a NaN.
    """

    low: Any
    shadow: Any
    probes: dict
    shadow_code: int


class Probe:
    """What is measured at each site: `measure` reduces the stacked values of sites of one
    shape and dtype to a tuple of arrays with one row per site; `combine` merges two sites'
    tuples (two results of one equation, two iterations, or a value and zeros)."""

    per_iteration = False

    def wants(self, aval: Any) -> bool:
        """Whether results of the abstract value `aval` are probed."""
        return is_half(aval)

    def measure(self, sites: Sequence[Site], low: Any, shadow: Any) -> tuple:
        """`low` and `shadow`: the sites' values stacked (one leading row per site)."""
        raise NotImplementedError

    def combine(self, a: tuple, b: tuple) -> tuple:
        raise NotImplementedError

    def over_iterations(self, stacked: tuple) -> tuple:
        """One site's probes of every iteration of a scan (a leading axis) as one."""
        raise NotImplementedError

    def over_while(self, so_far: dict, new: dict) -> dict:
        """A while body's probes by group after one more iteration (`new`); by default each
        group's `combine`d with those so far."""
        return {k: self.combine(so_far[k], new[k]) for k in so_far}


@dataclasses.dataclass
class _Level(Env):
    """The env of one body being walked: where its equations sit (the key of the body, the
    module path and pass of the call around it, the scans around it: see `Site.scans`), and
    the values met to be measured (`pending`) and the probes measured so far (`extras`). An
    inlined call shares its caller's `pending` and `extras` (`collects` False): its values are
    measured with its caller's."""

    key: tuple[int, ...] = ()
    path: tuple[str, ...] = ()
    backward: bool = False
    scans: tuple[int, ...] = ()
    pending: list = dataclasses.field(default_factory=list)
    collects: bool = True


class Evaluator(Interpreter[_Level]):
    """Walks programs with a probe; `sites` collects every site met, by key. Its values are
    (low, shadow) pairs."""

    def __init__(self, probe: Probe, shadow: bool = True):
        self.probe = probe
        self.shadow = shadow
        self.sites: dict[tuple[int, ...], Site] = {}
        # Where each site's probes are: (group, row) pairs (see `_collect`).
        self.rows: dict[tuple[int, ...], dict] = {}

    def instrumented(self, closed: jx.ClosedJaxpr, args: Sequence[Any]
                     ) -> tuple[list, list, dict]:
        """(low outputs, shadow outputs, probes by group) of `closed` on `args`, to be called
        while tracing (inside `jax.jit`); `by_site` reads each site's probes from the run's."""
        outs, probes = self.run(closed, [(a, self._widen(a)) for a in args], _Level(),
                                [(c, self._widen(c)) for c in closed.consts])
        return [low for low, _ in outs], [shadow for _, shadow in outs], probes

    def run_program(self, closed: jx.ClosedJaxpr, args: Sequence[Any]) -> Run:
        """Runs `closed` on `args` once, compiled (`run_once`), and fetches what `Run` holds to
        the host."""
        def instrumented(consts, flat):
            low, shadow, probes = self.instrumented(jx.ClosedJaxpr(closed.jaxpr, consts), flat)
            codes = [nonfinite.code(o) for o in shadow if is_inexact(o)]
            code = functools.reduce(jnp.bitwise_or, codes, jnp.zeros((), nonfinite.CODE_DTYPE))
            return low[:1], shadow[:1], probes, code

        low, shadow, probes, code = jax.device_get(
            run_once(instrumented, list(closed.consts), args))
        first = lambda values: values[0] if values else None
        return Run(first(low), first(shadow), self.by_site(probes), int(code))

    # -- the walk ----------------------------------------------------------------------------

    def new_env(self, closed: jx.ClosedJaxpr) -> _Level:
        return _Level()

    def read(self, env: _Level, atom: Any) -> Any:
        if isinstance(atom, jx.Literal):
            value = literal_value(atom)
            return value, self._widen(value)
        return env.values[atom]

    def default(self, env: _Level, eqn, invals: list) -> list:
        low_in = [low for low, _ in invals]
        shadow_in = [shadow for _, shadow in invals]
        low_out = jx.bind(eqn, eqn.params, low_in)
        if jx.bodies(eqn) and not jx.retypeable_scatter(eqn):
            shadow_out = self._opaque_shadow(eqn, shadow_in, low_out)
        else:
            shadow_out = self._shadow_bind(eqn, low_in, shadow_in, low_out)
            self._probe(env, eqn, low_out, shadow_out)
        return list(zip(low_out, shadow_out, strict=True))

    def finish(self, env: _Level) -> dict:
        if env.collects:
            self._collect(env)
        return env.extras

    def _inner(self, env: _Level, eqn, scan: bool = False, branch: tuple = (),
               inline: bool = False) -> Body:
        """The body evaluator of `eqn`'s bodies: inlined (sharing `env`'s values to measure),
        or a body of its own (a scan's, a while's, a branch `branch` of a cond)."""
        key = (*env.key, env.index)
        path = equation_path(eqn, env.path)
        backward = env.backward or jx.is_backward(eqn)
        if inline:
            return self.body(lambda closed: _Level(
                extras=env.extras, key=key, path=path, backward=backward, scans=env.scans,
                pending=env.pending, collects=False))
        scans = (*env.scans, len(key)) if scan else env.scans
        # The equations of a cond's branches are told apart by the branch's index in their keys.
        return self.body(lambda closed: _Level(key=(*key, *branch), path=path,
                                               backward=backward, scans=scans))

    def _call(self, env: _Level, eqn, invals: list) -> list:
        return control_flow.call(eqn, invals, self._inner(env, eqn, inline=True))[0]

    def _scan(self, env: _Level, eqn, invals: list) -> list:
        outs, probes = control_flow.scan(eqn, invals, self._inner(env, eqn, scan=True))
        for key, stacked in probes.items():
            env.extras[key] = stacked if self.probe.per_iteration else \
                self.probe.over_iterations(stacked)
        return outs

    def _while(self, env: _Level, eqn, invals: list) -> list:
        # The loop stops when the low run's condition says so.
        outs, probes = control_flow.while_loop(
            eqn, invals, self._inner(env, eqn),
            lambda closed, args: jx.eval_closed(closed, [low for low, _ in args])[0],
            combine=self.probe.over_while)
        env.extras.update(probes)
        return outs

    def _cond(self, env: _Level, eqn, invals: list) -> list:
        # The branch the low run takes runs in both; the other branches' probes read as zeros.
        bodies = [self._inner(env, eqn, branch=(k,)) for k in range(len(eqn.params["branches"]))]
        outs, probes = control_flow.switch(eqn, invals[0][0], invals[1:], bodies)
        env.extras.update(probes)
        return outs

    rules = {**dict.fromkeys(control_flow.CALL_PRIMITIVES, _call),
             "scan": _scan, "while": _while, "cond": _cond}

    # -- values ----------------------------------------------------------------------------

    def _widen(self, x):
        """The shadow of a low value: half values in float32."""
        if not self.shadow or not is_half(x):  # also keys and tokens, which have no dtype
            return x
        return np.asarray(x, FLOAT32) if isinstance(x, (np.ndarray, np.generic)) else \
            lax.convert_element_type(x, FLOAT32)

    def _shadow_bind(self, eqn, low_in, shadow_in, low_out):
        if not self.shadow:
            return low_out
        if all(sh is lo for sh, lo in zip(shadow_in, low_in)) and not _names_half(eqn.params):
            return low_out  # nothing half went in: the shadow computes the same values
        if eqn.primitive.name == "reduce_precision":
            # A rounding to a half dtype's bits (autocast's, which XLA keeps): the shadow does
            # not round, as a convert to a half dtype is float32 in it.
            return list(shadow_in)
        try:
            return jx.bind(eqn, _widened_params(eqn.params), shadow_in)
        except (TypeError, ValueError):
            # A primitive typed for its traced dtypes (a callback, a custom update
            # computation): the shadow takes the low run's results.
            return [self._widen(o) for o in low_out]

    def _opaque_shadow(self, eqn, shadow_in, low_out):
        if not self.shadow:
            return low_out
        typed = control_flow.cast_to_avals(shadow_in, [a.aval for a in eqn.invars])
        return [self._widen(o) for o in jx.bind(eqn, eqn.params, typed)]

    def _probe(self, env: _Level, eqn, low_out, shadow_out):
        if eqn.primitive.name in _UNPROBED:
            return
        half = [(v, lo, sh) for v, lo, sh in zip(eqn.outvars, low_out, shadow_out)
                if self.probe.wants(v.aval)]
        if not half:
            return
        key = (*env.key, env.index)
        site = Site(key, eqn, equation_path(eqn, env.path), env.backward or jx.is_backward(eqn),
                    np.dtype(half[0][0].aval.dtype), env.scans)
        self.sites[key] = site
        env.pending += [(site, j, lo, sh) for j, (_, lo, sh) in enumerate(half)]

    def _collect(self, env: _Level) -> None:
        """Measures the values met in a body, stacked by shape and dtype, into the body's
        probes by group (see `by_site` for each site's)."""
        groups: dict = {}
        for site, j, lo, sh in env.pending:
            group = (lo.shape, np.dtype(lo.dtype), np.dtype(sh.dtype), site.backward)
            groups.setdefault(group, []).append((site, j, lo, sh))
        env.pending.clear()
        for members in groups.values():
            sites = [m[0] for m in members]
            # A group is named by its first member (a site and which of its results): the
            # same name when a body is traced again (a while loop's or a branch's shapes
            # first), and no one else's.
            name = (*sites[0].key, -1 - members[0][1])
            for i, site in enumerate(sites):
                self.rows.setdefault(site.key, {})[(name, i)] = None
            env.extras[name] = self.probe.measure(sites, jnp.stack([m[2] for m in members]),
                                                  jnp.stack([m[3] for m in members]))

    def by_site(self, probes: dict) -> dict[tuple[int, ...], tuple]:
        """Each site's probes, by site key, from a run's probes by group (fetched to the host):
        one row of its group's (after the iteration axes of the scans around it, for a probe
        kept `per_iteration`), combined over the site's results."""
        out: dict = {}
        for key, rows in self.rows.items():
            axis = len(self.sites[key].scans) if self.probe.per_iteration else 0
            for name, i in rows:
                row = tuple(np.take(field, i, axis=axis) for field in probes[name])
                out[key] = row if key not in out else self.probe.combine(out[key], row)
        return out


# The debugger's programs run once: XLA's backend optimizations would cost more time compiling
# them than they save running them (and do not change the values computed).
_RUN_ONCE_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0}


def run_once(fn: Callable, *args):
    """`jax.jit(fn)(*args)`, compiled for a single run."""
    return jax.jit(fn).lower(*args).compile(_RUN_ONCE_OPTIONS)(*args)


def _names_half(params: dict) -> bool:
    return any(is_half_dtype(v) for v in params.values())


def _widened_params(params: dict) -> dict:
    """`params` with each half dtype (a convert's target, a matmul's result type) float32."""
    return {k: FLOAT32 if is_half_dtype(v) else v for k, v in params.items()}
