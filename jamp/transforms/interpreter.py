"""The autocast interpreter: the one evaluator (`jamp.walker.evaluate`) with autocast's rules.

First-order equations are re-bound with their inputs cast as `autocast_rules` decides.
Higher-order primitives get a rule each that transforms the sub-jaxprs and rebuilds the same
primitive around them (with `jamp.walker.control_flow`), so structure, custom derivative rules
and loop carry types survive:

- `jit` (and `closed_call`), `checkpoint`/`remat`, `shard_map`, `custom_jvp_call`: the body is
  transformed for the current input dtypes and may return lower-precision values, as the same
  ops would inline; a custom_jvp's rule is transformed for the same dtypes.
- `scan`, `while`: the carries take the dtypes the body gives them once those settle (see
  `_settled`); the loop keeps its traced interface otherwise.
- `cond`, `custom_vjp_call`: the body is transformed with its interface kept (inputs and
  outputs in the traced dtypes): branches must agree, and the user's bwd was written for those
  dtypes. The user's fwd is transformed like the body; the user's bwd runs with autocast off
  (torch's rule for custom backward functions) unless it is wrapped in `jamp.custom_bwd`.
  A `jamp.autograd.Function`'s custom_vjp (its bwd a `RetraceableCall`) is traced again for
  its inputs' current dtypes instead, and transformed like a `jit`, outputs included: torch's
  forward sees the dtypes its inputs arrive in.

Before a jaxpr is evaluated, `autocast_dataflow` marks the equations that compute the operands
of a float32 op (they run in float32 too), the results of normalization kernels (cast to
their activation's dtype as they leave) and the values a promoting function kernel reads (see
`jamp.policy.autocast_tables.Kernel`: a function a rule makes one torch kernel computes every op
in the kernel's dtype), the results of rounding kernels (`Kernel(FP32, rounded=True)`: gelu
and softmax on the cpu table, computed in float32 under one `jax.checkpoint` and rounded once
as they leave) and linear layers (their matmul accumulates in float32, the bias is added there
and the sum rounded once); `autocast_kernels` holds how these kernels compute. While it is
evaluated, passes (`autocast_facts`) keep what is known of its values: which are constants
of the program, which are scalar-like, which are weights, and which hold the low values of a
linear layer's kernel. A weight that such a value is added to as a bias, or that it scales or
gates, follows its dtype.

Each distinct sub-jaxpr is transformed once per program (per region, input types and constant
inputs).

A product a delayed fp8 recipe selects reads its state by where it sits (`autocast_delayed`):
the rules above pass the states into the bodies that hold such products (a scan slices them
per iteration, a `jit` holding one is inlined, a remat body closes over them) and refuse them
in the bodies that cannot thread them (while, cond, custom_jvp/custom_vjp, shard_map).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import lax

from jamp import _jax_internals as jx
from jamp.policy import dtypes, primitives
from jamp.policy.autocast_tables import FP32, LOWER
from jamp.transforms import autocast_dataflow as dataflow
from jamp.transforms import autocast_delayed
from jamp.transforms import autocast_facts
from jamp.transforms import autocast_fp8
from jamp.transforms import autocast_kernels
from jamp.transforms import autocast_rules as rules
from jamp.transforms import rules as precision_rules
from jamp.transforms.autocast_rules import Region
from jamp.walker import control_flow, walk
from jamp.walker.evaluate import Body, Env, Interpreter


@dataclasses.dataclass
class Context:
    """Per-program state of one autocast trace (never global).

    Attributes:
      cache_enabled: cast each value to each dtype once per jaxpr (torch's weight cache).
      jaxprs: transformed sub-jaxprs, keyed by (kind, sub-jaxpr, region, input types, constant
        inputs).
      regions: the region of each (enclosing region, name stack, function rules matched).
      plans: per (jaxpr, region), each equation's region and the equations that run in float32.
      substitutes: values to read in place of array literals, by the literal value's id
        (closed-over arrays passed afresh; see `programs`).
      decided: the precision rules that decided some equation (indices into the transform's).
      places: the (module path, function rules matched) of the equations seen with rules.
      overridden: the rules that matched equations a region inside their module set again.
      delayed: the sites of the delayed fp8 recipe, found or given their states
        (`autocast_delayed`); None for a program called without delayed state.
    """

    cache_enabled: bool = True
    substitutes: dict = dataclasses.field(default_factory=dict)
    jaxprs: dict = dataclasses.field(default_factory=dict)
    regions: dict = dataclasses.field(default_factory=dict)
    plans: dict = dataclasses.field(default_factory=dict)
    decided: set = dataclasses.field(default_factory=set)
    places: set = dataclasses.field(default_factory=set)
    overridden: set = dataclasses.field(default_factory=set)
    delayed: autocast_delayed.Sites | None = None

    def region_for(self, region: Region, eqn) -> Region:
        scope = region.scope
        functions = None if scope is None else scope.rules.functions_on(eqn)
        key = (region, jx.name_stack(eqn), functions)
        found = self.regions.get(key)
        if found is None:
            location = precision_rules.locate(region, jx.scope_names(eqn),
                                              functions or frozenset())
            found = location.region
            # Rules fold a region from the transform's own: the mark of a backward pass
            # (the equation's, or its enclosing call's) is carried in.
            if region.backward or jx.is_backward(eqn):
                found = dataclasses.replace(found, backward=True)
            self.regions[key] = found
            if scope is not None:
                self.places.add((location.path, found.scope.functions))
                if location.rule is not None:
                    self.decided.add(location.rule)
                if location.overridden is not None:
                    self.overridden.add(location.overridden)
        return found

    def plan(self, jaxpr: jx.Jaxpr, region: Region
             ) -> tuple[tuple[Region, ...], dataflow.Plan]:
        key = (jaxpr, region)
        if key not in self.plans:
            regions = tuple(self.region_for(region, eqn) for eqn in jaxpr.eqns)
            self.plans[key] = regions, dataflow.plan(jaxpr, regions)
        return self.plans[key]


def cast(x, dtype):
    """Casts a value; numpy scalars (literals) stay numpy so they remain literals."""
    if x.dtype == dtype:
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x, dtype=dtype)
    if dtypes.is_half_dtype(x.dtype) and dtype == dtypes.FLOAT32:
        return autocast_kernels.widened(x)
    return lax.convert_element_type(x, dtype)


def cast_to_avals(values: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
    """Casts each castable floating value to the dtype of its aval (e.g. back to the traced
    dtypes); other values are returned as they are."""
    return [cast(v, a.dtype) if hasattr(v, "dtype") and rules.is_castable(v.dtype)
            and rules.is_castable(a.dtype) else v for v, a in zip(values, avals, strict=True)]


def _avals_key(avals) -> tuple:
    return tuple((tuple(a.shape), a.dtype, bool(getattr(a, "weak_type", False)))
                 for a in avals)


def eval_jaxpr(closed: jx.ClosedJaxpr, args: Sequence[Any], region: Region, ctx: Context,
               constants: Sequence[np.generic | None] | None = None,
               consts: Sequence[Any] | None = None,
               carries: frozenset[int] = frozenset()) -> list[Any]:
    """Evaluates `closed` on `args` with autocast, binding on whatever trace is current.

    `constants` gives, per argument, the largest finite magnitude of an argument known to be a
    constant of the enclosing program (None where it is not one). `consts` replaces the
    jaxpr's own consts (closed-over arrays the caller passes afresh). `carries`: positions of
    a loop body's carries, which are the loop's values, never Python-scalar-like (see
    `autocast_facts.ScalarLikes`).
    """
    autocast = Autocast(ctx)
    return autocast.evaluate(closed, args, autocast.env_for(closed, region, constants, carries),
                             consts)


class _Evaluation(Env):
    """One evaluation of one jaxpr under autocast: its environment (`values`), where its
    equations sit (`regions`), what `autocast_dataflow` planned for it, the passes that keep
    facts about its values, and its casts."""

    def __init__(self, autocast: "Autocast", closed: jx.ClosedJaxpr, region: Region,
                 constants: Sequence[np.generic | None] | None, carries: frozenset[int]):
        super().__init__()
        jaxpr = closed.jaxpr
        self.regions, self.plan = autocast.ctx.plan(jaxpr, region)
        self.facts = autocast_facts.Facts(lambda atom: autocast.read(self, atom))
        self.casts = _Casts(lambda atom: autocast.read(self, atom), self.facts.constants,
                            autocast.ctx.cache_enabled)
        # Per argument: its magnitude if it is a constant of the program, and whether it is a
        # loop body's carry (the consts are neither).
        self.inputs = {var: (known, i in carries) for i, (var, known) in enumerate(
            zip(jaxpr.invars, constants or [None] * len(jaxpr.invars), strict=True))}
        # Where the jaxpr sits, for the delayed recipe's sites (see autocast_delayed).
        delayed = autocast.ctx.delayed
        self.where = autocast_delayed.Where() if delayed is None else delayed.where
        # The bias adds of linear layers whose matmul returned float32, each with the dtype
        # its result is rounded to (see `_layer_matmul`).
        self.rounding: dict[int, np.dtype] = {}
        # The results of the equations of a kernel run computed ahead (see `_kernel_run`).
        self.computed: dict[jx.Var, Any] = {}

    @property
    def eqn_region(self) -> Region:
        """The region of the equation being evaluated."""
        return self.regions[self.index]


class Autocast(Interpreter):
    """The autocast interpreter of one program (`ctx`): first-order equations go to `default`
    (cast as `autocast_rules` decides), higher-order ones to their rule in `rules`."""

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def env_for(self, closed: jx.ClosedJaxpr, region: Region,
                constants: Sequence[np.generic | None] | None = None,
                carries: frozenset[int] = frozenset()) -> _Evaluation:
        """The env of an evaluation of `closed` in `region` (see `eval_jaxpr`)."""
        return _Evaluation(self, closed, region, constants, carries)

    def read(self, env: Env, atom: Any) -> Any:
        if isinstance(atom, jx.Literal):
            substitute = self.ctx.substitutes.get(id(atom.val))
            if substitute is not None:
                return substitute
            # An integer or bool literal is bound as the program holds it: as a numpy value
            # it would be typed anew and lower differently (a gather's index).
            if not dtypes.is_floating(atom.aval):
                return atom.val
        return super().read(env, atom)

    def operands(self, env: _Evaluation, eqn: jx.JaxprEqn) -> list:
        # A call on a float32 chain takes float32 inputs (see autocast_dataflow); first-order
        # equations cast their own inputs (`_first_order`).
        if eqn.primitive.name in self.rules and env.index in env.plan.float32:
            return [env.casts.read(a, dtypes.FLOAT32) if _operand(self, env, a).castable
                    else self.read(env, a) for a in eqn.invars]
        return super().operands(env, eqn)

    def write(self, env: _Evaluation, var: jx.Var, value: Any) -> None:
        if env.index < 0:
            env.facts.bind(var, value, *env.inputs.get(var, (None, False)))
        elif var in env.plan.exits:
            value = _leave_kernel(self, env, env.plan.exits[var], value)
        elif var in env.plan.kernel_exits:
            value = _round_once(self, env, env.plan.kernel_exits[var], value)
        env.values[var] = value

    def default(self, env: _Evaluation, eqn: jx.JaxprEqn, invals: list) -> list:
        if jx.bodies(eqn) and not jx.retypeable_scatter(eqn):
            return _opaque(eqn, invals)
        return _first_order(self, env, eqn)


def _leave_kernel(autocast: Autocast, env: _Evaluation, activations, value):
    """A normalization's result, computed in float32, in the dtype of the activation it
    normalized, as the region reads it (see `autocast_dataflow.normalization_kernels` and
    `autocast_rules.entered`)."""
    dtype = rules.widest(rules.entered(env.eqn_region, autocast.read(env, a).dtype,
                                       np.dtype(a.aval.dtype)) for a in activations)
    return (autocast_kernels.rounded(value, dtype)
            if dtype in dtypes.HALF_DTYPES and value.dtype == dtypes.FLOAT32 else value)


def _round_once(autocast: Autocast, env: _Evaluation, region: Region, value):
    """A result of a rounding kernel (`Kernel.rounded`), computed in float32, rounded to the
    widest dtype the kernel reads as it leaves."""
    dtype = _promoted(autocast, env, region)
    return (autocast_kernels.rounded(value, dtype)
            if dtype in dtypes.HALF_DTYPES and value.dtype == dtypes.FLOAT32 else value)


class _Casts:
    """Values read in another dtype, each value cast to each dtype once per evaluation when
    the cache is enabled (torch's weight cache)."""

    def __init__(self, read: Callable[[Any], Any], constants: autocast_facts.Constants,
                 enabled: bool):
        self._read = read
        self._constants = constants
        self._enabled = enabled
        self._cache: dict = {}

    def read(self, atom, dtype, saturating: bool = False):
        """`atom`'s value in `dtype` (None: as it is); `saturating`: finite values beyond
        `dtype`'s range become its largest finite ones, not infinities."""
        value = self._read(atom)
        if dtype is None or value.dtype == dtype:
            return value
        if not self._enabled or isinstance(atom, jx.Literal):
            return self._cast(atom, value, dtype, saturating)
        key = (atom, dtype, saturating)
        if key not in self._cache:
            self._cache[key] = self._cast(atom, value, dtype, saturating)
        return self._cache[key]

    def _cast(self, atom, value, dtype, saturating: bool):
        # The rules narrow a constant the low dtype cannot hold only where an op selects it;
        # it becomes its nearest finite value there, never infinity.
        if saturating or rules.overflows(self._constants.of(atom), dtype):
            return cast(saturate(value, dtype), dtype)
        return cast(value, dtype)


def saturate(value, dtype):
    """`value` with finite entries beyond `dtype`'s range clipped to it (infinities kept)."""
    low, high = (np.asarray(v, value.dtype) for v in rules.finite_range(dtype))
    if isinstance(value, (np.ndarray, np.generic)):
        return np.where(np.isfinite(value), np.clip(value, low, high), value).astype(value.dtype)
    return lax.select(lax.is_finite(value), lax.clamp(low, value, high), value)


def _operand(autocast: Autocast, env: _Evaluation, atom) -> rules.Operand:
    """What the rules need to know of one input (see `autocast_rules.Operand`)."""
    if not dtypes.is_floating(atom.aval):
        return rules.Operand(None, None)
    return rules.Operand(autocast.read(env, atom).dtype, np.dtype(atom.aval.dtype),
                         follows=env.facts.scalar_likes.follows(atom),
                         constant=env.facts.constants.of(atom))


def _first_order(autocast: Autocast, env: _Evaluation, eqn) -> list[Any]:
    """A first-order equation re-bound with its inputs cast as `autocast_rules` decides."""
    name = eqn.primitive.name
    region = env.eqn_region
    facts = env.facts
    kernel = _kernel_dtype(autocast, env, region)
    if name == "convert_element_type":
        # An explicit cast in the program is honoured as written; one to the dtype a value
        # already has is dropped. Inside a torch kernel, the library's casts between
        # autocast's dtypes give the kernel's (its inputs' and result's).
        value = autocast.read(env, eqn.invars[0])
        new_dtype, weak_type = jx.convert_target(eqn)
        if (kernel is not None and rules.is_castable(value.dtype)
                and rules.is_castable(np.dtype(new_dtype))):
            outs = [cast(value, kernel)]
        elif value.dtype == np.dtype(new_dtype) and not weak_type:
            outs = [value]
        else:
            outs = jx.bind(eqn, eqn.params, [value])
        facts.note(eqn, outs)
        return outs
    if name == "optimization_barrier" and region.cast_inputs is not None:
        values = [autocast.read(env, a) for a in eqn.invars]
        targets = [region.cast_inputs if rules.is_castable(v.dtype) else None
                   for v in values]
        return jx.bind(eqn, eqn.params, [cast(v, t) if t is not None else v
                                         for v, t in zip(values, targets, strict=True)])
    floating = [dtypes.is_floating(a.aval) for a in eqn.invars]
    if not any(floating):
        outs = jx.bind(eqn, eqn.params, [autocast.read(env, a) for a in eqn.invars])
        facts.note(eqn, outs)
        return outs
    if env.index in env.rounding:
        return _layer_bias(env, eqn)
    if env.index in env.plan.kernel_runs:
        _kernel_run(autocast, env, env.plan.kernel_runs[env.index])
    if eqn.outvars[0] in env.computed:
        outs = [env.computed.pop(v) for v in eqn.outvars]
        facts.note(eqn, outs)
        return outs
    operands = [_operand(autocast, env, a) for a in eqn.invars]
    follower = facts.kernels.follower(eqn)
    if follower is not None:
        operands[follower] = dataclasses.replace(operands[follower], follows=True)
    wide = any(dtypes.is_wide(v.aval) for v in (*eqn.invars, *eqn.outvars))
    scalar = dataflow.sums_to_scalar(eqn)
    # An equation that computes operands of a float32 op runs in float32 (see
    # autocast_dataflow).
    targets = rules.input_targets(
        name, region, operands, float32=env.index in env.plan.float32,
        traced_only=jx.declares_result_types(eqn.params), wide_values=wide,
        scalar_result=scalar, kernel=kernel)
    # A bias is a weight, but an argument taken for one may be an additive mask full of
    # finfo(float32).min: narrowed, it saturates rather than becoming -inf (a real bias that
    # large would overflow the layer's result anyway). A scale is cast plainly.
    bias = follower if name in primitives.ADDITIVE else None
    invals = [env.casts.read(a, t, saturating=i == bias)
              for i, (a, t) in enumerate(zip(eqn.invars, targets, strict=True))]
    if not wide and autocast_fp8.runs_in_fp8(
            eqn, region, lambda: facts.kernels.is_linear_layer(eqn, region)):
        return _fp8_product(autocast, env, eqn, invals[0])
    # Inputs of one traced dtype now share one (`_promote`); a dot product traced with mixed
    # inputs (jnp.matmul of bfloat16 and float32) computes in their promotion, as traced.
    result = rules.widest(v.dtype for v, f in zip(invals, floating, strict=True) if f)
    # A result-dtype param (a matmul's preferred_element_type) that restates the traced
    # operands' promoted type follows the dtype the op now runs in: a lowered matmul of a
    # bfloat16 and a float32 input returns bfloat16, as torch's does.
    traced = rules.widest(o.traced for o in operands if o.traced is not None)
    params = eqn.params if wide else jx.with_result_dtype(eqn.params, traced, result)
    if result in dtypes.HALF_DTYPES and env.index in env.plan.linears:
        return _layer_matmul(env, eqn, params, result, invals)
    if (result in dtypes.HALF_DTYPES and kernel is None and name in primitives.COMBINING
            and any(_unheld_python_float(o, result) for o in operands)):
        # torch computes with a Python float in float32 and rounds the result once.
        in_float32 = [cast(autocast.read(env, a), dtypes.FLOAT32) if f else v
                      for a, v, f in zip(eqn.invars, invals, floating, strict=True)]
        outs = [autocast_kernels.rounded(o, result)
                for o in jx.bind(eqn, eqn.params, in_float32)]
        facts.note(eqn, outs)
        return outs
    if result in dtypes.HALF_DTYPES and rules.accumulates_in_fp32(name, region, scalar):
        invals = [cast(v, dtypes.FLOAT32) if f else v
                  for v, f in zip(invals, floating, strict=True)]
        params = jx.with_result_dtype(params, result, dtypes.FLOAT32)
        outs = [cast(o, result) if dtypes.is_floating(o) else o
                for o in jx.bind(eqn, params, invals)]
        facts.note(eqn, outs)
        return outs
    facts.kernels.note(eqn, region, result)
    outs = jx.bind(eqn, params, invals)
    facts.note(eqn, outs)
    return outs


def _kernel_run(autocast: Autocast, env: _Evaluation, run: dataflow.KernelRun) -> None:
    """Computes a rounding kernel's equations as the program has them, in float32, from its
    inputs widened inside one `jax.checkpoint`: the backward recomputes them from the low
    inputs it saves, as torch's gelu and softmax backward kernels do. Their results wait in
    `env.computed`; those read outside are rounded as they leave (`_round_once`)."""
    outvars = [v for eqn in run.eqns for v in eqn.outvars]

    def compute(*inputs):
        values = {v: (cast(x, dtypes.FLOAT32) if rules.is_castable(x.dtype) else x)
                  for v, x in zip(run.inputs, inputs, strict=True)}
        for eqn in run.eqns:
            invals = [autocast.read(env, a) if isinstance(a, jx.Literal) else values[a]
                      for a in eqn.invars]
            values.update(zip(eqn.outvars, jx.bind(eqn, eqn.params, invals), strict=True))
        return [values[v] for v in outvars]

    results = jax.checkpoint(compute)(*[autocast.read(env, v) for v in run.inputs])
    env.computed.update(zip(outvars, results, strict=True))


def _layer_matmul(env: _Evaluation, eqn, params, low: np.dtype, invals) -> list[Any]:
    """The matmul of torch's `linear`, `conv` or `addmm` (see
    `autocast_dataflow.linear_kernels`): its `low` operands accumulate in float32, and the
    result stays float32 until its bias is added (`_layer_bias`)."""
    env.rounding[env.plan.linears[env.index]] = low
    env.facts.kernels.note(eqn, env.eqn_region, low)
    outs = [autocast_kernels.matmul_in_float32(eqn, params, *invals)]
    env.facts.note(eqn, outs)
    return outs


def _layer_bias(env: _Evaluation, eqn) -> list[Any]:
    """The bias add that ends a linear layer's kernel: the bias, cast to the layer's low
    dtype as torch casts it, is added to the float32 accumulator and the sum rounded once."""
    low = env.rounding.pop(env.index)
    bias = next(i for i, a in enumerate(eqn.invars) if a in env.facts.weights)
    operands = [env.values[a] for a in eqn.invars]
    operands[bias] = autocast_kernels.bias_in_float32(
        env.casts.read(eqn.invars[bias], low, saturating=True), eqn.outvars[0].aval.shape)
    outs = [autocast_kernels.rounded(jx.bind(eqn, eqn.params, operands)[0], low)]
    env.facts.kernels.mark(eqn.outvars)
    env.facts.note(eqn, outs)
    return outs


def _unheld_python_float(operand: rules.Operand, low: np.dtype) -> bool:
    """A Python float (a constant that follows the other operand) traced in float32 that
    `low` cannot hold: `x * 0.125` holds, `x * 0.3` does not."""
    constant = operand.constant
    return (operand.follows and constant is not None and operand.traced == dtypes.FLOAT32
            and constant.astype(low) != constant)


def _fp8_product(autocast: Autocast, env: _Evaluation, eqn, lhs) -> list[Any]:
    """A linear layer in a module set to an fp8 recipe (`autocast_fp8`): the input `lhs` read
    in the dtype the rules give it, the weight in its own."""
    region = env.eqn_region
    rhs = autocast.read(env, eqn.invars[1])
    # Its module path: module rules' scope holds it; without them (a recipe given as the
    # transform's dtype) it is read from where the jaxpr sits and the equation's own scopes.
    path = (precision_rules.module_path((), region.scope.names)
            if region.scope is not None and region.scope.rules.modules
            else precision_rules.module_path((), (*env.where.names, *jx.scope_names(eqn))))
    state = None
    if region.fp8.scaling == "delayed":
        delayed = autocast.ctx.delayed
        if delayed is None:
            raise TypeError(
                f"{region.fp8!r} keeps state the call must pass: call the function as "
                "jamp.fp8.with_state(fn)(state, *args), with state from "
                "jamp.fp8.init_autocast_state(fn, *args) (docs/fp8.md, \"Delayed scaling\").")
        state = delayed.state(env.where, env.index, eqn, region.fp8)
    outs = [autocast_fp8.product(eqn, lhs, rhs, region, path, state)]
    env.facts.kernels.note(eqn, region, outs[0].dtype)
    env.facts.note(eqn, outs)
    return outs


def _kernel_dtype(autocast: Autocast, env: _Evaluation, region: Region) -> np.dtype | None:
    """The dtype of the torch kernel an equation sits in (`Region.kernel`), where autocast is
    on; else None. A promoting kernel's is the widest current dtype of the values it reads
    (Python scalars follow)."""
    if not region.enabled or region.kernel is None:
        return None
    if region.kernel == FP32:
        return dtypes.FLOAT32
    if region.kernel == LOWER:
        return region.dtype
    return _promoted(autocast, env, region)


def _promoted(autocast: Autocast, env: _Evaluation, region: Region) -> np.dtype | None:
    """The widest current dtype of the values a kernel's region reads (Python scalars
    follow)."""
    return rules.widest(autocast.read(env, v).dtype for v in env.plan.kernel_reads[region]
                        if v in env.values and not env.facts.scalar_likes.follows(v))


def _opaque(eqn, invals) -> list[Any]:
    """A higher-order primitive without a rule runs untransformed in its traced dtypes."""
    return jx.bind(eqn, eqn.params, _to_traced(eqn, invals))


def _to_traced(eqn, invals) -> list[Any]:
    return cast_to_avals(invals, [a.aval for a in eqn.invars])


# -- transformed sub-jaxprs -------------------------------------------------------------------

def specialized(closed: jx.ClosedJaxpr, region: Region, ctx: Context,
                values: Sequence[Any], constants: Sequence[Any] = ()) -> jx.ClosedJaxpr:
    """`closed` transformed for the dtypes of `values`; outputs in whatever dtypes result.

    `constants` (per value, see `eval_jaxpr`) are part of the key: inside the body a constant
    input is still known to be one.
    """
    return specialized_at(closed, region, ctx, _weak_literal_avals(values),
                          tuple(constants) or (None,) * len(values))


def specialized_at(closed: jx.ClosedJaxpr, region: Region, ctx: Context, avals: Sequence[Any],
                   constants: Sequence[Any], carries: frozenset[int] = frozenset(),
                   side_avals: Sequence[Any] = ()) -> jx.ClosedJaxpr:
    """`specialized` for abstract inputs (a loop body's, typed by its carries and slices),
    its `carries` (positions) never scalar-like (see `eval_jaxpr`). `side_avals`: a scan
    body's delayed states, taken after its inputs (`autocast_delayed.Sites.sliced`)."""
    constants = tuple(constants)
    delayed = ctx.delayed
    key = ("specialized", closed, region, _avals_key(avals), constants, carries,
           None if delayed is None else delayed.key(), _avals_key(side_avals))
    if key not in ctx.jaxprs:
        def run(*args):
            # A scan body's sites get their states, one iteration's, as its last inputs.
            with (delayed.inside(delayed.sliced(delayed.where, args[len(avals):]))
                  if delayed is not None and side_avals else contextlib.nullcontext()):
                return eval_jaxpr(closed, args[:len(avals)], region, ctx, constants,
                                  carries=carries)

        ctx.jaxprs[key] = jx.trace_closed(run, [*avals, *side_avals])
    return ctx.jaxprs[key]


def _weak_literal_avals(values) -> list[Any]:
    """Avals of the values passed into a sub-jaxpr; rank-0 literals (numpy scalars here) become
    weak-typed, so that inside the body they still follow the other operand."""
    return [jx.weak_aval(v) if isinstance(v, (np.ndarray, np.generic)) and np.ndim(v) == 0
            else jax.typeof(v) for v in values]


def interface_kept(closed: jx.ClosedJaxpr, region: Region, ctx: Context) -> jx.ClosedJaxpr:
    """`closed` transformed with its input and output types unchanged (casts inside)."""
    key = ("kept", closed, region, None if ctx.delayed is None else ctx.delayed.key())
    if key not in ctx.jaxprs:
        ctx.jaxprs[key] = jx.trace_closed(
            lambda *args: _eval_kept(closed, args, region, ctx), closed.in_avals)
    return ctx.jaxprs[key]


def _eval_kept(closed, args, region, ctx) -> list[Any]:
    return cast_to_avals(eval_jaxpr(closed, args, region, ctx), closed.out_avals)


def _running(transformed: jx.ClosedJaxpr) -> Body:
    """A body evaluator (`jamp.walker.control_flow`) that runs `transformed`, the body it is
    given already transformed (a loop's, settled for its carries), in its place."""
    return lambda closed, args: (jx.eval_closed(transformed, list(args)), {})


def _kept_bodies(region: Region, ctx: Context) -> Body:
    """A body evaluator that runs each body it is given transformed with its interface kept
    (`interface_kept`)."""
    return lambda closed, args: (jx.eval_closed(interface_kept(closed, region, ctx), list(args)),
                                 {})


# -- higher-order rules -----------------------------------------------------------------------

def _constants(env: _Evaluation, eqn) -> list[np.generic | None]:
    """The magnitude of each input of `eqn` that is a constant of the program (else None)."""
    return [env.facts.constants.of(a) for a in eqn.invars]


def _inside(autocast: Autocast, env: _Evaluation, eqn, refused: str | None = None,
            length: int | None = None) -> Callable[[], contextlib.AbstractContextManager]:
    """A context in which the bodies of `eqn` are transformed where they sit, for the delayed
    recipe's sites (`autocast_delayed.Sites.body`); it may be entered later (a rule JAX
    traces when it differentiates)."""
    delayed = autocast.ctx.delayed
    if delayed is None:
        return contextlib.nullcontext
    where = delayed.body(env.where, env.index, eqn, refused, length)
    return lambda: delayed.inside(where)


def _jit_rule(autocast: Autocast, env: _Evaluation, eqn, invals):
    delayed = autocast.ctx.delayed
    if delayed is not None and delayed.has_sites(where := delayed.body(env.where, env.index,
                                                                         eqn)):
        # Inlined: its delayed sites read their states by address, which a body shared by
        # the calls of one function would not tell apart.
        with delayed.inside(where):
            body = autocast.body(lambda closed: autocast.env_for(closed, env.eqn_region,
                                                                 _constants(env, eqn)))
            return control_flow.call(eqn, invals, body)[0]
    # Re-bound with its body transformed once per program for these inputs (rather than
    # traced again at each call): a function called many times (jnp's jitted helpers)
    # lowers to one function.
    new = specialized(eqn.params[jx.call_body_key(eqn.params)], env.eqn_region, autocast.ctx,
                      invals, _constants(env, eqn))
    return control_flow.jit(eqn, invals, new)[0]


def _remat_rule(autocast: Autocast, env: _Evaluation, eqn, invals):
    constants = _constants(env, eqn)
    body = autocast.body(lambda closed: autocast.env_for(closed, env.eqn_region, constants))
    # Its delayed sites close over their states: jax.checkpoint makes them its inputs.
    with _inside(autocast, env, eqn)():
        return control_flow.remat(eqn, invals, body)[0]


def _shard_map_rule(autocast: Autocast, env: _Evaluation, eqn, invals):
    constants = _constants(env, eqn)
    body = autocast.body(lambda closed: autocast.env_for(closed, env.eqn_region, constants))
    with _inside(autocast, env, eqn, refused="shard_map")():
        return control_flow.shard_map(eqn, invals, body)[0]


def _cond_rule(autocast: Autocast, env: _Evaluation, eqn, invals):
    """Branches keep their interface: they must agree on their outputs' types."""
    invals = _to_traced(eqn, invals)
    with _inside(autocast, env, eqn, refused="cond")():
        return control_flow.switch(eqn, invals[0], invals[1:],
                                   _kept_bodies(env.eqn_region, autocast.ctx))[0]


def _scan_rule(autocast: Autocast, env: _Evaluation, eqn, invals):
    """A scan whose carries take the dtypes its body gives them (see `_settled`); one whose
    carries do not settle keeps its interface. The delayed states of its body's sites come in
    stacked, as more xs."""
    with _inside(autocast, env, eqn, length=jx.scan_parts(eqn.params)[3]["length"])():
        return _scan(autocast, env, eqn, invals)


def _scan(autocast: Autocast, env: _Evaluation, eqn, invals):
    region, ctx = env.eqn_region, autocast.ctx
    body, num_consts, num_carry, _ = jx.scan_parts(eqn.params)
    side = [] if ctx.delayed is None else autocast_delayed.stacked(ctx.delayed.where)
    side_avals = [jax.typeof(s).update(shape=s.shape[1:]) for s in side]
    consts = invals[:num_consts]
    init = invals[num_consts:num_consts + num_carry]
    xs = invals[num_consts + num_carry:]
    inner_constants = [*_constants(env, eqn)[:num_consts], *[None] * (len(invals) - num_consts)]
    fixed = [jax.typeof(v) for v in consts]
    x_avals = [jax.typeof(x).update(shape=x.shape[1:]) for x in xs]
    positions = range(num_consts, num_consts + num_carry)
    adding = dataflow.accumulating_carries(body.jaxpr, positions, range(num_carry))
    settled = _settled(
        lambda carries: specialized_at(body, region, ctx, [*fixed, *carries, *x_avals],
                                       inner_constants, frozenset(positions), side_avals),
        init, body.in_avals[num_consts:num_consts + num_carry], adding)
    if settled is None:
        if side:
            raise ValueError("A scan whose body runs the delayed fp8 recipe has carries whose "
                             "dtypes do not settle under autocast: keep its carries in one "
                             "dtype, or give its modules a current-scaling recipe.")
        return control_flow.scan(eqn, _to_traced(eqn, invals), _kept_bodies(region, ctx))[0]
    closed, carry_avals = settled
    return control_flow.scan(eqn, [*consts, *_as_carries(init, carry_avals), *xs, *side],
                             _running(closed))[0]


def _while_rule(autocast: Autocast, env: _Evaluation, eqn, invals):
    """A while loop whose carries take the dtypes its body gives them (see `_settled`), its
    condition transformed for the same dtypes; one whose carries do not settle keeps its
    interface."""
    with _inside(autocast, env, eqn, refused="while_loop")():
        return _while(autocast, env, eqn, invals)


def _while(autocast: Autocast, env: _Evaluation, eqn, invals):
    region, ctx = env.eqn_region, autocast.ctx
    constants = _constants(env, eqn)
    cond, body, cond_n, body_n = jx.while_parts(eqn.params)
    cond_consts, body_consts = invals[:cond_n], invals[cond_n:cond_n + body_n]
    init = invals[cond_n + body_n:]
    body_fixed = [jax.typeof(v) for v in body_consts]
    body_constants = [*constants[cond_n:cond_n + body_n], *[None] * len(init)]
    positions = range(body_n, body_n + len(init))
    adding = dataflow.accumulating_carries(body.jaxpr, positions, range(len(init)))
    settled = _settled(
        lambda carries: specialized_at(body, region, ctx, [*body_fixed, *carries],
                                       body_constants, frozenset(positions)),
        init, body.in_avals[body_n:], adding)
    if settled is None:
        kept = _kept_bodies(region, ctx)
        return control_flow.while_loop(eqn, _to_traced(eqn, invals), kept,
                                       lambda closed, args: kept(closed, args)[0][0])[0]
    body_closed, carry_avals = settled
    cond_closed = specialized_at(cond, region, ctx,
                                 [*map(jax.typeof, cond_consts), *carry_avals],
                                 [*constants[:cond_n], *[None] * len(init)],
                                 frozenset(range(cond_n, cond_n + len(init))))
    return control_flow.while_loop(
        eqn, [*cond_consts, *body_consts, *_as_carries(init, carry_avals)],
        _running(body_closed), lambda closed, args: jx.eval_closed(cond_closed, args)[0])[0]


def _settled(trace_body: Callable, init: Sequence[Any], traced: Sequence[Any],
             adding: Sequence[bool]):
    """A loop body traced for carries of the dtypes it returns them in, and those carries'
    avals; None when they do not settle.

    torch's recurrent layers (and a Python loop over lowered ops) return their states in the
    low dtype; a JAX loop's carries must keep one type across iterations. Starting from the
    initial carries' current dtypes, the body (`trace_body(carry_avals)`, its carries its
    first outputs) is traced until the carries it returns have the dtypes it was given; the
    initial carries are then cast to those. A carry the body adds to (`adding`: an
    accumulator, a time, a residual stream; see `autocast_dataflow.accumulating_carries`)
    keeps its `traced` dtype: in the low dtype its small steps would be lost. A loop whose
    carries do not settle keeps its traced interface (casts inside).
    """
    carry_avals = [(t if add else jax.typeof(v)).update(weak_type=False)
                   for v, t, add in zip(init, traced, adding, strict=True)]
    for _ in range(_CARRY_ROUNDS):
        closed = trace_body(carry_avals)
        returned = closed.out_avals[:len(carry_avals)]
        if [a.dtype for a in returned] == [a.dtype for a in carry_avals]:
            return closed, carry_avals
        carry_avals = [a.update(dtype=r.dtype) if rules.is_castable(a.dtype) and not add else a
                       for a, r, add in zip(carry_avals, returned, adding, strict=True)]
    return None


def _as_carries(values: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
    """Initial carries in their settled dtypes, strongly typed as the body takes them."""
    return [lax.convert_element_type(v, a.dtype) if hasattr(v, "dtype")
            and rules.is_castable(v.dtype) and rules.is_castable(a.dtype) else v
            for v, a in zip(values, avals, strict=True)]


# How many times a loop body is traced for its carries' dtypes to settle (a carry the body
# lowers settles in two: traced once in float32, once in the low dtype).
_CARRY_ROUNDS = 3


def _custom_jvp_rule(autocast: Autocast, env: _Evaluation, eqn, invals):
    # Specialized to the current dtypes, like jit: jax.nn.relu of a bfloat16 value stays
    # bfloat16. The user's jvp rule is evaluated for the same dtypes (the helper casts its
    # outputs to the primal body's, so primal and tangent types agree as JAX requires).
    region, ctx = env.eqn_region, autocast.ctx
    primal = jx.custom_call_body(eqn.params)
    inside = _inside(autocast, env, eqn, refused="custom_jvp")
    with inside():
        call = specialized(primal, region, ctx, invals, _constants(env, eqn))
    if _may_run_fp8(region) and _float8_values(call) > _float8_values(primal):
        # Products an fp8 rule selects came in (a linear layer's kernel of an autocast
        # nested inside, O1's apply function): they carry their own derivatives, the float8
        # GEMMs of the recipe, which a jvp rule cannot run (JAX transposes what a jvp rule
        # computes, and a float8 cast of a tangent is not linear). Differentiated through them.
        return jx.eval_closed(call, list(invals))

    def body(closed, args):
        if closed is primal:
            return jx.eval_closed(call, list(args)), {}
        # The rule may be traced later, when JAX differentiates the program.
        with inside():
            return autocast.run(closed, args, autocast.env_for(closed, region))

    return control_flow.custom_jvp(eqn, invals, body)[0]


def _may_run_fp8(region: Region) -> bool:
    """Whether products in `region` (or in modules inside it) may run through `jamp.fp8`:
    its own recipe, or a rule that sets one."""
    return region.fp8 is not None or (region.scope is not None
                                      and region.scope.rules.sets_recipes)


def _float8_values(closed: jx.ClosedJaxpr) -> int:
    """How many float8 values the equations of `closed` (and of its bodies) compute."""
    return sum(dtypes.is_fp8_dtype(dtypes.dtype_of(v.aval)) for e in walk.equations(closed)
               for v in e.outvars)


class RetraceableCall:
    """The bwd of a `jax.custom_vjp` call whose forward can be traced again for other input
    dtypes: a `jamp.autograd.Function`'s, whose `backward` takes grads of any dtype and
    returns them in its inputs' dtypes (`_custom_vjp_rule`). A subclass's instance is passed
    to `defvjp` as the bwd, where autocast finds it.

    Attributes:
      cast_inputs: the dtype of the forward's `jamp.custom_fwd(cast_inputs=...)`, or None.
    """

    cast_inputs: np.dtype | None = None

    def retraced(self, *inputs) -> Sequence[Any]:
        """The call's outputs (those of its `custom_vjp_call`), for inputs that are the
        call's non-constant inputs in other dtypes: traced anew, so its Python sees them."""
        raise NotImplementedError


def _custom_vjp_rule(autocast: Autocast, env: _Evaluation, eqn, invals):
    region, ctx = env.eqn_region, autocast.ctx
    bwd = jx.custom_vjp_bwd(eqn.params)
    with _inside(autocast, env, eqn, refused="custom_vjp")():
        if isinstance(bwd, RetraceableCall):
            return _retraceable_rule(eqn, bwd, invals, region, ctx, _constants(env, eqn))
        return control_flow.custom_vjp(eqn, invals, _kept_bodies(region, ctx),
                                       _bwd_in(region.off_as_is(), ctx))[0]


def _retraceable_rule(eqn, bwd: RetraceableCall, invals, region, ctx, constants):
    """A `jamp.autograd.Function`, as torch runs one under autocast.

    Its forward is Python that may read its inputs' dtypes (a kernel per dtype), traced when
    the program was traced, in the program's dtypes. torch's forward sees the dtypes its
    inputs arrive in (a lowered matmul's bfloat16; with `custom_fwd(cast_inputs=...)` in an
    enabled region, that dtype), runs its ops under autocast and returns what they give. So
    the call is traced again for the dtypes its inputs have here; at its own dtypes, its body
    and fwd are transformed for those dtypes like a `jit`'s, outputs included. Its backward
    then gets grads in those outputs' dtypes and runs with autocast off (or, under
    `custom_bwd`, in the forward's region), as torch's does; the Function casts the grads it
    returns to its inputs' dtypes.
    """
    num_consts = jx.custom_call_num_consts(eqn.params)
    inputs = invals[num_consts:]
    if bwd.cast_inputs is not None and region.enabled:
        inputs = [cast(v, bwd.cast_inputs) if rules.is_castable(v.dtype) else v
                  for v in inputs]
    if [v.dtype for v in inputs] != [a.aval.dtype for a in eqn.invars[num_consts:]]:
        avals = _weak_literal_avals(inputs)
        key = ("retraced", bwd, _avals_key(avals))
        if key not in ctx.jaxprs:
            ctx.jaxprs[key] = jx.trace_closed(bwd.retraced, avals)
        return eval_jaxpr(ctx.jaxprs[key], inputs, region, ctx, constants[num_consts:])
    invals = [*invals[:num_consts], *inputs]
    call = specialized(jx.custom_call_body(eqn.params), region, ctx, invals, constants)
    num_outs = len(call.out_avals)

    def fwd_in_call_dtypes(fwd: jx.ClosedJaxpr) -> jx.ClosedJaxpr:
        # The fwd returns the residuals, then the outputs: those in the body's dtypes, which
        # are the call's (JAX takes the output tangents' types from the fwd).
        def body(*args):
            outs = eval_jaxpr(fwd, args, region, ctx)
            return (outs[:len(outs) - num_outs]
                    + cast_to_avals(outs[len(outs) - num_outs:], call.out_avals))

        return jx.trace_closed(body, fwd.in_avals)

    params = jx.custom_vjp_params(eqn.params, call, fwd_in_call_dtypes,
                                  _bwd_in(region.off_as_is(), ctx))
    return jx.bind(eqn, params, invals)


def _bwd_in(bwd_region: Region, ctx: Context) -> Callable[[Callable], Callable]:
    """Wraps a custom_vjp's bwd to be traced and evaluated in `bwd_region`: autocast off,
    or, under custom_bwd, the forward's region."""

    def wrap_bwd(bwd: Callable) -> Callable:
        # Symbolic zeros (the cotangents of unused outputs, under `symbolic_zeros=True`, as
        # jamp.autograd.Function's) pass around the trace untouched.
        def new_bwd(*args):
            zeros = {i: a for i, a in enumerate(args) if jx.is_symbolic_zero(a)}
            given = [a for i, a in enumerate(args) if i not in zeros]

            def with_zeros(a):
                it = iter(a)
                return [zeros[i] if i in zeros else next(it) for i in range(len(args))]

            seen: dict = {}

            def arrays_only(*a):
                cts, logs = jx.split_bwd_result(bwd(*with_zeros(a)))
                seen["cts"], seen["logs"] = cts, logs
                leaves, seen["logs_tree"] = jax.tree_util.tree_flatten(
                    None if jx.has_no_logs(logs) else logs)
                return [c for c in cts if not jx.is_symbolic_zero(c)] + leaves

            closed = jx.trace_closed(arrays_only, [jax.typeof(a) for a in given])
            values = _eval_kept(closed, given, bwd_region, ctx)
            num_cts = len(values) - seen["logs_tree"].num_leaves
            arrays = iter(values[:num_cts])
            cts = [c if jx.is_symbolic_zero(c) else next(arrays) for c in seen["cts"]]
            logs = jax.tree_util.tree_unflatten(seen["logs_tree"], values[num_cts:])
            return jx.join_bwd_result(cts, logs, seen["logs"])

        return new_bwd

    return wrap_bwd


Autocast.rules = {
    **dict.fromkeys(jx.FUNCTION_CALLS, _jit_rule),
    "remat2": _remat_rule,
    "shard_map": _shard_map_rule,
    "scan": _scan_rule,
    "while": _while_rule,
    "cond": _cond_rule,
    "custom_jvp_call": _custom_jvp_rule,
    "custom_vjp_call": _custom_vjp_rule,
}


__all__ = [
    "Autocast", "Context", "RetraceableCall", "cast", "cast_to_avals", "eval_jaxpr",
    "interface_kept", "saturate", "specialized", "specialized_at",
]
