"""What autocast needs to know about a jaxpr before it evaluates it: which equations compute the
operands of a float32 op, and so run in float32 themselves.

torch decides dtypes per ATen kernel: `layer_norm`, `softmax` or `mse_loss` read their inputs and
compute everything inside in float32, and torch's norm kernels compute their statistics in float32
on every device. In a jaxpr those kernels are chains of primitives, and the decisive float32
primitive (`rsqrt` of a variance, `exp` of a softmax, the `reduce_sum` of a loss) sits at the end
of a chain that would otherwise run in the low dtype: the variance `E[x^2] - E[x]^2` in bfloat16,
`x - max(x)` in float16. So float32 is demanded backwards from each float32 op, through the
elementwise, structural and reduction ops that produce its operands, up to the values the chain
starts from: a value that other ops also use at full size (an activation, the residual stream)
stays as it is and is cast to float32 where the chain reads it, so only the kernel's inside
changes. Reads by the backward pass (a `jax.grad` inside the transformed function) and by the
caller (values returned beside a loss) do not count as such uses. Reduced values (statistics: means, variances, maxima) are small: once demanded, they are
computed in float32 for every use. A nested `jit` (or custom_jvp, remat) on the chain takes
float32 inputs: given those, its elementwise ops run in float32 (its matmuls still lower), and
many jnp functions (`jnp.clip`, `jnp.where`) are such jits. A matmul that asks for full precision
(`precision=HIGHEST`, as `jnp.linalg`'s composites write their inner matmuls) is a float32 op too.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from jamp.policy.autocast_tables import ACCUMULATE_FP32, FP32, LOWER
from jamp.policy.primitives import CALLS, CHAIN, ELEMENTWISE, REDUCTIONS, SUMS
from jamp.transforms import _jax_internals as jx
from jamp.transforms.autocast_rules import Region, is_castable, is_floating


def float32_equations(jaxpr: jx.Jaxpr, regions: Sequence[Region]) -> frozenset[int]:
    """Indices of the equations that compute in float32: float32 ops and the chains feeding them.

    Args:
      jaxpr: the program.
      regions: the autocast region of each equation.
    """
    eqns = jaxpr.eqns
    # Two kinds of reader take a chain's float32 value without spreading float32 further, so
    # they do not keep a value out of a chain: the backward pass (a `jax.grad` inside the
    # transformed function reads the forward's results, as torch's backward kernels read the
    # forward's float32 ones) and the caller (a loss's per-example values returned beside
    # it: outputs go back in their traced dtypes). Only the forward's own uses can.
    backward = [jx.is_backward(eqn) for eqn in eqns]
    from_backward = {v for eqn, b in zip(eqns, backward, strict=True) if b for v in eqn.outvars}

    def counted(i: int) -> list:
        """The inputs of equation `i` whose use counts: a backward equation's reads of forward
        values are left out."""
        return [v for v in eqns[i].invars
                if _is_var(v) and (not backward[i] or v in from_backward)]

    uses: Counter = Counter()
    for i in range(len(eqns)):
        uses.update(counted(i))
    reduced = _statistics(jaxpr)

    demanded_uses: Counter = Counter()

    def demanded(var) -> bool:
        return demanded_uses[var] > 0 and (var in reduced or demanded_uses[var] >= uses[var])

    seeds = {i for i, (eqn, region) in enumerate(zip(eqns, regions, strict=True))
             if _is_seed(eqn, region) and any(_castable(v) for v in eqn.outvars)}
    # An op that combines a float32 op's result with other values computes in float32 anyway
    # (it promotes): `shifted - log(sum(exp(shifted)))` in log_softmax, `max(x, 0) +
    # log1p(...)` in softplus. Its other operands belong to the same kernel.
    float32_results = {v for i in seeds for v in eqns[i].outvars}

    result = set()
    for i in reversed(range(len(eqns))):
        eqn, region = eqns[i], regions[i]
        if not region.enabled or not any(_castable(v) for v in eqn.outvars):
            continue
        name = eqn.primitive.name
        rule = region.table.rule(name, sums_to_scalar(eqn))
        feeds = ((name in CHAIN or name in CALLS) and rule in (None, ACCUMULATE_FP32) and (
            any(demanded(v) for v in eqn.outvars)
            or (name in ELEMENTWISE and any(_is_var(v) and v in float32_results
                                            for v in eqn.invars))))
        if not (i in seeds or feeds):
            continue
        result.add(i)
        demanded_uses.update(v for v in counted(i) if _castable(v))
    return frozenset(result)


def _is_seed(eqn, region: Region) -> bool:
    """A float32 op. A matmul written for full precision (jnp.linalg's composites ask for
    HIGHEST inside pinv, lstsq, solve, inv) is one too: torch's linear algebra kernels compute
    in float32 throughout."""
    if not region.enabled:
        return False
    rule = region.table.rule(eqn.primitive.name, sums_to_scalar(eqn))
    return rule == FP32 or (rule == LOWER and jx.asks_full_precision(eqn.params))


def sums_to_scalar(eqn) -> bool:
    """A sum of arrays to one number: a loss's final mean, a dot product, a trace."""
    return (eqn.primitive.name in SUMS and all(not v.aval.shape for v in eqn.outvars)
            and any(_castable(v) and v.aval.shape for v in eqn.invars if _is_var(v)))


def _statistics(jaxpr: jx.Jaxpr) -> frozenset:
    """Values computed from reductions alone (means, variances, maxima, a scale made of them):
    small, and cheap to hold in float32."""
    reduced: set = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        inputs = [v for v in eqn.invars if _is_var(v) and is_floating(v.aval)]
        # Scalars (a count, `ddof`) may join a statistic: `jnp.var` divides by `n - ddof`.
        if name in REDUCTIONS or (
                name in (CHAIN | CALLS) and any(v in reduced for v in inputs)
                and all(v in reduced or not v.aval.shape for v in inputs)):
            reduced.update(eqn.outvars)
        elif name in CALLS:  # jnp.var and jnp.mean are jits
            body = jx.call_body(eqn).jaxpr
            inner = _statistics(body)
            reduced.update(o for o, b in zip(eqn.outvars, body.outvars, strict=True)
                           if b in inner)
    return frozenset(reduced)


def _is_var(atom) -> bool:
    return not isinstance(atom, jx.Literal)


def _castable(var) -> bool:
    return is_castable(getattr(var.aval, "dtype", None))
