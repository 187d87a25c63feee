"""The debugger's evaluator: a program run equation by equation, with a float32 shadow.

`evaluate` walks a closed jaxpr (the program autocast made, with its backward pass) while it is
traced into one `jax.jit` program. Every equation is bound twice: on the program's own values
(the low run, float16 or bfloat16 where autocast put them) and, in the shadow, on float32
values: the same equation with each half dtype of its operands and params widened to float32.
The half values each equation returns are measured by a `Probe`, which reduces them to a few
numbers (largest magnitude, counts of tiny values...) that leave the program as extra outputs.
The values of equations of one shape and dtype are stacked and measured together, once per
body: one reduction per shape rather than one per equation keeps the program small to compile. The
shadow is what an ideal float32 run of the same program computes, so whether a value fits the
half dtype is read from it, whatever XLA keeps in registers in the low run.

Bodies are walked in place, each equation of them a site of its own:

- calls (`jit`, `closed_call`, `remat`, `custom_jvp_call`, `custom_vjp_call`) are inlined: only
  their values are needed here, and the program is never differentiated again, so a custom
  derivative rule (which only differentiation reads) changes nothing;
- `scan`: the body runs in a `lax.scan` that carries both runs; its probes come out per
  iteration and are combined over iterations (maxima, sums) or kept per iteration
  (`Probe.per_iteration`);
- `while`: both runs are carried; probes are combined in the carry; the loop stops when the
  low run's condition says so;
- `cond`: the branch the low run takes runs in both; the other branches' probes read as
  neutral.

Every other higher-order primitive (`shard_map`, ...) runs whole in both runs, in the low
run's dtypes, and is not looked inside.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp import _jax_internals as jx
from jamp.policy import primitives
from jamp.transforms.rules import equation_path

HALF = frozenset(np.dtype(d) for d in (jnp.float16, jnp.bfloat16))
FLOAT32 = np.dtype(np.float32)
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


class Probe:
    """What is measured at each site: `measure` reduces the stacked values of sites of one
    shape and dtype to a tuple of arrays with one row per site; `combine` merges two sites'
    tuples (two results of one equation, two iterations, or a value and zeros)."""

    per_iteration = False

    def wants(self, dtype: np.dtype) -> bool:
        """Whether results of `dtype` are probed."""
        return dtype in HALF

    def measure(self, sites: Sequence[Site], low: Any, shadow: Any) -> tuple:
        """`low` and `shadow`: the sites' values stacked (one leading row per site)."""
        raise NotImplementedError

    def combine(self, a: tuple, b: tuple) -> tuple:
        raise NotImplementedError

    def over_iterations(self, stacked: tuple) -> tuple:
        """One site's probes of every iteration of a scan (a leading axis) as one."""
        raise NotImplementedError


@dataclasses.dataclass
class _Level:
    """Where the equations being walked sit: the key of the body, the module path and pass of
    the call around it, the scans around it (see `Site.scans`); and the probes measured so
    far."""

    key: tuple[int, ...]
    path: tuple[str, ...]
    backward: bool
    scans: tuple[int, ...]
    probes: dict
    pending: list = dataclasses.field(default_factory=list)


class Evaluator:
    """Walks programs with a probe; `sites` collects every site met, by key."""

    def __init__(self, probe: Probe, shadow: bool = True):
        self.probe = probe
        self.shadow = shadow
        self.sites: dict[tuple[int, ...], Site] = {}
        # Where each site's probes are: (group, row) pairs (see `_collect`).
        self.rows: dict[tuple[int, ...], dict] = {}

    def run(self, closed: jx.ClosedJaxpr, args: Sequence[Any]) -> tuple[list, list, dict]:
        """(low outputs, shadow outputs, probes by group) of `closed` on `args`, to be called
        while tracing (inside `jax.jit`); `by_site` reads each site's probes from the run's."""
        level = _Level((), (), False, (), {})
        low, shadow = self._eval(closed.jaxpr, closed.consts, list(args),
                                 [self._widen(a) for a in args], level)
        return low, shadow, self._collect(level)

    def run_program(self, closed: jx.ClosedJaxpr, args: Sequence[Any]) -> tuple[Any, Any, dict]:
        """Runs `closed` on `args` once, compiled (`run_once`), and fetches (its first output in
        the low run, the same in the shadow, each site's probes by key) to the host."""
        def instrumented(consts, flat):
            low, shadow, probes = self.run(jx.ClosedJaxpr(closed.jaxpr, consts), flat)
            return low[:1], shadow[:1], probes

        low, shadow, probes = jax.device_get(run_once(instrumented, list(closed.consts), args))
        first = lambda values: values[0] if values else None
        return first(low), first(shadow), self.by_site(probes)

    # -- values ----------------------------------------------------------------------------

    def _widen(self, x):
        """The shadow of a low value: half values in float32."""
        if not self.shadow:
            return x
        if _dtype(x) not in HALF:  # also keys and tokens, which have no numpy dtype
            return x
        return np.asarray(x, FLOAT32) if isinstance(x, (np.ndarray, np.generic)) else \
            lax.convert_element_type(x, FLOAT32)

    def _eval(self, jaxpr: jx.Jaxpr, consts, low_args, shadow_args, level: _Level):
        low_env: dict = {}
        shadow_env: dict = {}

        def read(env, atom, widen):
            if isinstance(atom, jx.Literal):
                value = np.asarray(atom.val, atom.aval.dtype) if hasattr(atom.aval, "dtype") \
                    else atom.val
                return self._widen(value) if widen else value
            return env[atom]

        low_env.update(zip(jaxpr.constvars, consts, strict=True))
        shadow_env.update(zip(jaxpr.constvars, [self._widen(c) for c in consts], strict=True))
        low_env.update(zip(jaxpr.invars, low_args, strict=True))
        shadow_env.update(zip(jaxpr.invars, shadow_args, strict=True))
        for i, eqn in enumerate(jaxpr.eqns):
            low_in = [read(low_env, a, False) for a in eqn.invars]
            shadow_in = [read(shadow_env, a, True) for a in eqn.invars]
            key = (*level.key, i)
            path = equation_path(eqn, level.path)
            backward = level.backward or jx.is_backward(eqn)
            rule = _RULES.get(eqn.primitive.name)
            with jx.equation_context(eqn):
                if rule is not None:
                    inner = _Level(key, path, backward, level.scans, level.probes,
                                   level.pending)
                    low_out, shadow_out = rule(self, eqn, low_in, shadow_in, inner)
                elif jx.bodies(eqn) and not jx.retypeable_scatter(eqn):
                    low_out = jx.bind(eqn, eqn.params, low_in)
                    shadow_out = self._opaque_shadow(eqn, low_in, shadow_in, low_out)
                else:
                    low_out = jx.bind(eqn, eqn.params, low_in)
                    shadow_out = self._shadow_bind(eqn, low_in, shadow_in, low_out)
                    self._probe(eqn, key, path, backward, level, low_out, shadow_out)
            low_env.update(zip(eqn.outvars, low_out, strict=True))
            shadow_env.update(zip(eqn.outvars, shadow_out, strict=True))
        return ([read(low_env, v, False) for v in jaxpr.outvars],
                [read(shadow_env, v, True) for v in jaxpr.outvars])

    def _shadow_bind(self, eqn, low_in, shadow_in, low_out):
        if not self.shadow:
            return low_out
        if all(s is l for s, l in zip(shadow_in, low_in)) and not _names_half(eqn.params):
            return low_out  # nothing half went in: the shadow computes the same values
        try:
            return jx.bind(eqn, _widened_params(eqn.params), shadow_in)
        except (TypeError, ValueError):
            # A primitive typed for its traced dtypes (a callback, a custom update
            # computation): the shadow takes the low run's results.
            return [self._widen(o) for o in low_out]

    def _opaque_shadow(self, eqn, low_in, shadow_in, low_out):
        if not self.shadow:
            return low_out
        typed = [lax.convert_element_type(s, a.aval.dtype) if hasattr(s, "dtype")
                 and s.dtype != a.aval.dtype else s for s, a in zip(shadow_in, eqn.invars)]
        return [self._widen(o) for o in jx.bind(eqn, eqn.params, typed)]

    def _probe(self, eqn, key, path, backward, level: _Level, low_out, shadow_out):
        if eqn.primitive.name in _UNPROBED:
            return
        half = [(v, l, s) for v, l, s in zip(eqn.outvars, low_out, shadow_out)
                if _dtype(v.aval) is not None and self.probe.wants(_dtype(v.aval))]
        if not half:
            return
        site = Site(key, eqn, path, backward, np.dtype(half[0][0].aval.dtype), level.scans)
        self.sites[key] = site
        level.pending += [(site, j, lo, sh) for j, (_, lo, sh) in enumerate(half)]

    def _collect(self, level: _Level) -> dict:
        """Measures the values met in a body, stacked by shape and dtype; returns the body's
        probes by group (see `by_site` for each site's)."""
        groups: dict = {}
        for site, j, lo, sh in level.pending:
            group = (lo.shape, np.dtype(lo.dtype), np.dtype(sh.dtype), site.backward)
            groups.setdefault(group, []).append((site, j, lo, sh))
        level.pending.clear()
        for members in groups.values():
            sites = [m[0] for m in members]
            # A group is named by its first member (a site and which of its results): the
            # same name when a body is traced again (a while loop's or a branch's shapes
            # first), and no one else's.
            name = (*sites[0].key, -1 - members[0][1])
            for i, site in enumerate(sites):
                self.rows.setdefault(site.key, {})[(name, i)] = None
            level.probes[name] = self.probe.measure(sites, jnp.stack([m[2] for m in members]),
                                                    jnp.stack([m[3] for m in members]))
        return level.probes

    def by_site(self, probes: dict) -> dict[tuple[int, ...], tuple]:
        """Each site's probes, by site key, from a run's probes by group (fetched to the host):
        one row of its group's (after the iteration axes of the scans around it, for a probe
        kept `per_iteration`), combined over the site's results."""
        out = {}
        for key, rows in self.rows.items():
            axis = len(self.sites[key].scans) if self.probe.per_iteration else 0
            for name, i in rows:
                row = tuple(np.take(field, i, axis=axis) for field in probes[name])
                out[key] = row if key not in out else self.probe.combine(out[key], row)
        return out


# The debugger's programs run once: XLA's backend optimizations would cost more time compiling
# them than they save running them (and do not change the values computed).
_RUN_ONCE_OPTIONS = {"xla_backend_optimization_level": 0}


def run_once(fn: Callable, *args):
    """`jax.jit(fn)(*args)`, compiled for a single run."""
    lowered = jax.jit(fn).lower(*args)
    try:
        compiled = lowered.compile(_RUN_ONCE_OPTIONS)
    except TypeError:  # a jax whose `compile` takes no options
        compiled = lowered.compile()
    return compiled(*args)


def _dtype(aval) -> np.dtype | None:
    """An array value's numpy dtype (None for tokens, keys and the like)."""
    try:
        return np.dtype(aval.dtype)
    except (AttributeError, TypeError):
        return None


def _names_half(params: dict) -> bool:
    return any(_is_half_dtype(v) for v in params.values())


def _is_half_dtype(value) -> bool:
    try:
        return isinstance(value, (np.dtype, type)) and np.dtype(value) in HALF
    except TypeError:
        return False


def _widened_params(params: dict) -> dict:
    """`params` with each half dtype (a convert's target, a matmul's result type) float32."""
    return {k: FLOAT32 if _is_half_dtype(v) else v for k, v in params.items()}


# -- higher-order rules -------------------------------------------------------------------------

def _inline(ev: Evaluator, eqn, low_in, shadow_in, level: _Level):
    name = eqn.primitive.name
    if name == "custom_vjp_call":
        body = jx.custom_call_body(eqn.params)
    else:
        body = jx.call_body(eqn)
    body = body if isinstance(body, jx.ClosedJaxpr) else jx.ClosedJaxpr(body, ())
    return ev._eval(body.jaxpr, body.consts, low_in, shadow_in, level)


def _sub_level(level: _Level, scan: bool = False, branch: int | None = None) -> _Level:
    scans = (*level.scans, len(level.key)) if scan else level.scans
    # The equations of a cond's branches are told apart by the branch's index in their keys.
    key = level.key if branch is None else (*level.key, branch)
    return _Level(key, level.path, level.backward, scans, {})


def _scan(ev: Evaluator, eqn, low_in, shadow_in, level: _Level):
    body, num_consts, num_carry, options = jx.scan_parts(eqn.params)
    split = lambda vals: (vals[:num_consts], vals[num_consts:num_consts + num_carry],
                          vals[num_consts + num_carry:])
    low_c, low_init, low_xs = split(low_in)
    sh_c, sh_init, sh_xs = split(shadow_in)

    def step(carry, xs):
        low_carry, shadow_carry = carry
        low_x, shadow_x = xs
        inner = _sub_level(level, scan=True)
        low, shadow = ev._eval(body.jaxpr, body.consts, [*low_c, *low_carry, *low_x],
                               [*sh_c, *shadow_carry, *shadow_x], inner)
        return ((low[:num_carry], _like(shadow[:num_carry], shadow_carry)),
                (low[num_carry:], shadow[num_carry:], ev._collect(inner)))

    (low_carry, shadow_carry), (low_ys, shadow_ys, probes) = lax.scan(
        step, (low_init, sh_init), (low_xs, sh_xs), **options)
    for key, stacked in probes.items():
        level.probes[key] = stacked if ev.probe.per_iteration else \
            ev.probe.over_iterations(stacked)
    return [*low_carry, *low_ys], [*shadow_carry, *shadow_ys]


def _like(values, reference):
    """`values` in the dtypes of `reference` (a loop's carries keep their type)."""
    return [lax.convert_element_type(v, r.dtype) if hasattr(v, "dtype") and v.dtype != r.dtype
            else v for v, r in zip(values, reference, strict=True)]


def _zeros(shapes):
    """Probes that change nothing when combined (a loop's start, a branch not taken): every
    probe is a maximum, a sum or an any, of which zero is the neutral value."""
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _while(ev: Evaluator, eqn, low_in, shadow_in, level: _Level):
    cond, body, cond_n, body_n = jx.while_parts(eqn.params)
    low_cc, low_bc, low_init = (low_in[:cond_n], low_in[cond_n:cond_n + body_n],
                                low_in[cond_n + body_n:])
    sh_bc, sh_init = shadow_in[cond_n:cond_n + body_n], shadow_in[cond_n + body_n:]

    def run_body(low_carry, shadow_carry):
        inner = _sub_level(level)
        low, shadow = ev._eval(body.jaxpr, body.consts, [*low_bc, *low_carry],
                               [*sh_bc, *shadow_carry], inner)
        return low, _like(shadow, shadow_carry), ev._collect(inner)

    # The probes' structure, from one abstract run of the body: the loop carries them.
    shapes = jax.eval_shape(lambda l, s: run_body(l, s)[2], low_init, sh_init)
    start = _zeros(shapes)

    def cond_fn(carry):
        low_carry = carry[0]
        return jx.eval_closed(cond, [*low_cc, *low_carry])[0]

    def body_fn(carry):
        low_carry, shadow_carry, probes = carry
        low, shadow, new = run_body(low_carry, shadow_carry)
        return low, shadow, {k: ev.probe.combine(probes[k], new[k]) for k in probes}

    low, shadow, probes = lax.while_loop(cond_fn, body_fn, (low_init, sh_init, start))
    level.probes.update(probes)
    return low, shadow


def _cond(ev: Evaluator, eqn, low_in, shadow_in, level: _Level):
    index, low_ops, shadow_ops = low_in[0], low_in[1:], shadow_in[1:]
    branches = eqn.params["branches"]

    def branch_fn(k):
        def run(low, shadow):
            inner = _sub_level(level, branch=k)
            closed = branches[k]
            lo, sh = ev._eval(closed.jaxpr, closed.consts, list(low), list(shadow), inner)
            return lo, sh, ev._collect(inner)
        return run

    shapes = [jax.eval_shape(branch_fn(k), low_ops, shadow_ops) for k in range(len(branches))]
    # Each branch returns every branch's probes (the others' as zeros), one structure for all.
    union = {}
    for _, _, probes in shapes:
        union.update(probes)
    out_shadow = shapes[0][1]

    def padded(k):
        def run(low, shadow):
            lo, sh, probes = branch_fn(k)(low, shadow)
            sh = [lax.convert_element_type(s, o.dtype) for s, o in zip(sh, out_shadow)]
            filled = {key: probes[key] if key in probes else _zeros(shape)
                      for key, shape in union.items()}
            return lo, sh, filled
        return run

    low, shadow, probes = lax.switch(index, [padded(k) for k in range(len(branches))],
                                     low_ops, shadow_ops)
    level.probes.update(probes)
    return low, shadow


_RULES: dict[str, Callable] = {
    **dict.fromkeys(jx.FUNCTION_CALLS, _inline),
    "remat2": _inline,
    "custom_jvp_call": _inline,
    "custom_vjp_call": _inline,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}


__all__ = ["Evaluator", "FLOAT32", "HALF", "Probe", "run_once", "Site"]
