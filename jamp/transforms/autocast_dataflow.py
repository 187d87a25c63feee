"""What autocast needs to know about a jaxpr before it evaluates it: which equations compute the
operands of a float32 op, and so run in float32 themselves, and where a normalization's kernel
ends (see `Plan`).

torch decides dtypes per ATen kernel: `layer_norm`, `softmax` or `mse_loss` read their inputs and
compute everything inside in float32, and torch's norm kernels compute their statistics in float32
on every device. In a jaxpr those kernels are chains of primitives, and the decisive float32
primitive (`rsqrt` of a variance, `exp` of a softmax, the `reduce_sum` of a loss) sits at the end
of a chain that would otherwise run in the low dtype: the variance `E[x^2] - E[x]^2` in bfloat16,
`x - max(x)` in float16. So float32 is demanded backwards from each float32 op, through the
elementwise, structural and reduction ops that produce its operands, up to the values the chain
starts from: a value that other ops also use at full size (an activation, the residual stream)
stays as it is and is cast to float32 where the chain reads it, so only the kernel's inside
changes. Reads by the backward pass (a `jax.grad` inside the transformed function), by tests
(comparisons, `isnan`) and by the caller (values returned beside a loss) do not count as such
uses. Reduced values (statistics: means, variances, maxima) are small: once demanded, they are
computed in float32 for every use. A nested `jit` (or custom_jvp, remat) on the chain takes
float32 inputs: given those, its elementwise ops run in float32 (its matmuls still lower), and
many jnp functions (`jnp.clip`, `jnp.where`) are such jits; one whose own chains start from an
input demands that input, as if inlined. A matmul that asks for full precision
(`precision=HIGHEST`, as `jnp.linalg`'s composites write their inner matmuls) is a float32 op too.

These passes are dataflows over values: each reads one jaxpr's equations in order (or backwards)
and follows a value into a call's body by its position. A listing of every equation with its
enclosing ones (`jamp.walker.walk`, which the tally and `primitive_names` share) would lose
which value of the body is which operand, so they keep their own loops; the primitive names they
read are the table's (`jamp.policy.primitives`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from typing import Mapping, Sequence, TypeGuard, cast


from jamp.policy.autocast_tables import ACCUMULATE_FP32, FP32, FP32_STATISTICS, LOWER, PROMOTE
from jamp.policy.primitives import (
    ADDS, ASSEMBLES, CHAIN, COMBINING, DOT_PRODUCTS, ELEMENTWISE, MOVES, REDUCTIONS,
    SAME_VALUES, SELECTIONS, SUMS,
)
from jamp import _jax_internals as jx
from jamp._jax_internals import CALLS
from jamp.policy.dtypes import FLOAT32, is_floating, is_half
from jamp.transforms.autocast_rules import Region, is_castable
from jamp.transforms.rules import region_of


@dataclasses.dataclass(frozen=True)
class Plan:
    """What autocast evaluates a jaxpr with.

    Attributes:
      float32: indices of the equations that compute in float32.
      exits: results of a normalization kernel (see `normalization_kernels`) that leave it in
        the dtype of the activation it normalized, each with the kernel's full-size inputs:
        the result takes their widest current dtype when that is below float32.
      linears: each linear layer's matmul index with its bias add's (see `linear_kernels`).
      kernel_reads: per region of a function that is one promoting kernel (`Kernel(PROMOTE)`)
        or one that rounds its results (`Kernel(..., rounded=True)`), the floating values its
        equations read from outside it (see `kernel_reads`).
      kernel_exits: the results of a rounding kernel read outside it, each with the kernel's
        region: they leave it rounded to the widest dtype it reads (see `kernel_exits`).
      kernel_runs: the rounding kernels that run as one rematerialized float32 function, by
        the index of their first equation (see `kernel_runs`).
    """

    float32: frozenset[int]
    exits: Mapping[jx.Var, tuple[jx.Var, ...]]
    linears: Mapping[int, int] = dataclasses.field(default_factory=dict)
    kernel_reads: Mapping[Region, tuple[jx.Var, ...]] = dataclasses.field(default_factory=dict)
    kernel_exits: Mapping[jx.Var, Region] = dataclasses.field(default_factory=dict)
    kernel_runs: Mapping[int, "KernelRun"] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class KernelRun:
    """Consecutive equations of one rounding kernel, all first-order forward ops traced in
    float32 (`jax.nn.gelu` of a float32 program): they compute the kernel as the program has
    it, from its inputs widened to float32.

    Attributes:
      eqns: the equations, in order.
      inputs: the values they read that they do not compute (literals aside).
    """

    eqns: tuple
    inputs: tuple


def plan(jaxpr: jx.Jaxpr, regions: Sequence[Region]) -> Plan:
    """The float32 equations of `jaxpr` (see `float32_equations`), its normalization
    kernels' results (see `normalization_kernels`) and its linear layers (see
    `linear_kernels`)."""
    linears = linear_kernels(jaxpr, regions)
    float32 = float32_equations(jaxpr, regions)
    epilogue, exits = normalization_kernels(jaxpr, regions, float32)
    while epilogue:
        # The ops that finish a normalization read its operands in float32 too (flax's
        # RMSNorm centres by a constant zero mean outside the statistics' chain).
        float32 = float32_equations(jaxpr, regions, float32 | epilogue)
        epilogue, exits = normalization_kernels(jaxpr, regions, float32)
    return Plan(float32, exits, linears, kernel_reads(jaxpr, regions),
                kernel_exits(jaxpr, regions), kernel_runs(jaxpr, regions))


def kernel_reads(jaxpr: jx.Jaxpr, regions: Sequence[Region]
                 ) -> dict[Region, tuple[jx.Var, ...]]:
    """Per region of a promoting kernel (torch's `cosine_similarity` casts its inputs to their
    promoted dtype before it computes), the castable values its equations read that it does
    not compute itself: its inputs, whose widest dtype it computes in."""
    reads: dict[Region, dict] = {}
    inside: dict[Region, set] = {}
    for eqn, region in zip(jaxpr.eqns, regions, strict=True):
        if region.kernel != PROMOTE and not region.rounded:
            continue
        computed = inside.setdefault(region, set())
        found = reads.setdefault(region, {})
        found.update((v, None) for v in eqn.invars
                     if _is_var(v) and _castable(v) and v not in computed)
        computed.update(eqn.outvars)
    return {region: tuple(found) for region, found in reads.items()}


def kernel_exits(jaxpr: jx.Jaxpr, regions: Sequence[Region]) -> dict[jx.Var, Region]:
    """The castable results of rounding kernels (torch's CPU `gelu` computes in float32 and
    rounds once) that an equation outside the kernel reads or the jaxpr returns, each with
    the kernel's region."""
    made = {v: region for eqn, region in zip(jaxpr.eqns, regions, strict=True)
            if region.rounded for v in eqn.outvars if _castable(v)}
    exits = {v: made[v] for v in jaxpr.outvars if _is_var(v) and v in made}
    for eqn, region in zip(jaxpr.eqns, regions, strict=True):
        exits.update((v, made[v]) for v in eqn.invars
                     if _is_var(v) and v in made and made[v] != region)
    return exits


def kernel_runs(jaxpr: jx.Jaxpr, regions: Sequence[Region]) -> dict[int, KernelRun]:
    """The rounding kernels whose equations are consecutive first-order forward ops that read
    and compute no floating value below float32, by the index of their first equation (see
    `KernelRun`). Computed as one function under `jax.checkpoint`, such a kernel saves its
    (low) inputs for the backward, as torch's does, not its float32 intermediates."""
    runs: dict[int, KernelRun] = {}
    eqns = jaxpr.eqns
    i = 0
    while i < len(eqns):
        region = regions[i]
        end = i
        while end < len(eqns) and regions[end] == region and region.rounded:
            end += 1
        run = eqns[i:end]
        if run and all(_computes_in_float32(e) for e in run):
            made = {v for e in run for v in e.outvars}
            inputs = {v: None for e in run for v in e.invars if _is_var(v) and v not in made}
            runs[i] = KernelRun(tuple(run), tuple(inputs))
        i = max(end, i + 1)
    return runs


def _computes_in_float32(eqn) -> bool:
    return (not jx.bodies(eqn) and not jx.is_backward(eqn)
            and all(not is_floating(v.aval) or v.aval.dtype == FLOAT32
                    for v in (*eqn.invars, *eqn.outvars)))


def float32_equations(jaxpr: jx.Jaxpr, regions: Sequence[Region],
                      demanding: frozenset[int] = frozenset()) -> frozenset[int]:
    """Indices of the equations that compute in float32: float32 ops and the chains feeding them.

    Args:
      jaxpr: the program.
      regions: the autocast region of each equation.
      demanding: equations that compute in float32 for another reason (a normalization's
        epilogue): they demand float32 operands as float32 ops do.
    """
    return _chains(jaxpr, regions, demanding)[0]


def _chains(jaxpr: jx.Jaxpr, regions: Sequence[Region], demanding: frozenset[int] = frozenset()
            ) -> tuple[frozenset[int], tuple[bool, ...]]:
    """`float32_equations`, and for each input of the jaxpr whether the chains start there
    (every use of it computes in float32)."""
    eqns = jaxpr.eqns
    # Three kinds of reader take a chain's float32 value without spreading float32 further, so
    # they do not keep a value out of a chain: the backward pass (a `jax.grad` inside the
    # transformed function reads the forward's results, as torch's backward kernels read the
    # forward's float32 ones), tests (comparisons, `isnan`, `argmax`: they compute no floating
    # value) and the caller (a loss's per-example values returned beside it: outputs go back
    # in their traced dtypes). Only the forward's own floating uses can.
    backward = [jx.is_backward(eqn) for eqn in eqns]
    from_backward = {v for eqn, b in zip(eqns, backward, strict=True) if b for v in eqn.outvars}
    tests = [not any(_castable(v) or is_floating(v.aval) for v in eqn.outvars)
             and eqn.primitive.name not in CALLS for eqn in eqns]

    def counted(i: int) -> list:
        """The inputs of equation `i` whose use counts: a backward equation's reads of forward
        values, and a test's reads, are left out."""
        if tests[i]:
            return []
        return [v for v in eqns[i].invars
                if _is_var(v) and (not backward[i] or v in from_backward)]

    uses: Counter = Counter()
    for i in range(len(eqns)):
        uses.update(counted(i))
    # A linear layer's bias add is inside its low-precision kernel: a float32 chain after the
    # layer starts from the layer's result, as torch's float32 kernel reads its low output.
    layers = {j for i, k in linear_kernels(jaxpr, regions).items() for j in range(i + 1, k + 1)}
    reduced = _statistics(jaxpr)

    demanded_uses: Counter = Counter()

    def demanded(var) -> bool:
        return demanded_uses[var] > 0 and (var in reduced or demanded_uses[var] >= uses[var])

    seeds = {i for i, (eqn, region) in enumerate(zip(eqns, regions, strict=True))
             if _is_seed(eqn, region) and any(_castable(v) for v in eqn.outvars)}
    float32_ops = set(seeds)
    seeds |= demanding
    # An op that combines a float32 op's result with other values computes in float32 anyway
    # (it promotes): `shifted - log(sum(exp(shifted)))` in log_softmax, `max(x, 0) +
    # log1p(...)` in softplus. Its other operands belong to the same kernel, and so do those
    # of the ops that go on computing from its result (softplus selects `x + 0` where its
    # input is NaN). A normalization's statistics (`FP32_STATISTICS`) reach only the ops
    # that apply them: its kernel ends where `normalization_kernels` says. Moves pass a
    # result on; explicit casts end it.
    float32_results = {v for i in float32_ops for v in eqns[i].outvars}
    spreading = {v for i in float32_ops if _rule(eqns[i], regions[i]) != FP32_STATISTICS
                 for v in eqns[i].outvars}
    for i, eqn in enumerate(eqns):
        name = eqn.primitive.name
        if backward[i] or name == "convert_element_type" or not (
                name in ELEMENTWISE or name in MOVES):
            continue
        reads = {v for v in eqn.invars if _is_var(v)}
        if reads & spreading:
            spreading.update(eqn.outvars)
            float32_results.update(eqn.outvars)
        elif name in MOVES and reads & float32_results:
            float32_results.update(eqn.outvars)

    result = set()
    for i in reversed(range(len(eqns))):
        eqn, region = eqns[i], regions[i]
        if not region.enabled or not any(_castable(v) for v in eqn.outvars):
            continue
        name = eqn.primitive.name
        rule = _rule(eqn, region)
        feeds = ((name in CHAIN or name in CALLS) and rule in (None, ACCUMULATE_FP32)
                 and i not in layers and (
            any(demanded(v) for v in eqn.outvars)
            or (name in ELEMENTWISE and any(_is_var(v) and v in float32_results
                                            for v in eqn.invars))))
        if not (i in seeds or feeds):
            if name in CALLS and region.enabled:
                # A call whose own chains start from some inputs demands those, as if
                # inlined; it is not a float32 op itself: its body casts what it reads.
                starts = _starts_in_body(eqn, region)
                demanded_uses.update(v for v, start in zip(eqn.invars, starts, strict=True)
                                     if start and _is_var(v) and _castable(v))
            continue
        result.add(i)
        demanded_uses.update(v for v in counted(i) if _castable(v))
    return frozenset(result), tuple(demanded(v) for v in jaxpr.invars)


def weights(jaxpr: jx.Jaxpr) -> dict:
    """The jaxpr's inputs and the values moved or assembled from them only, each with the
    (size, rank) of the input it comes from (see `moved_weight`)."""
    origins = {v: shape_key(v) for v in (*jaxpr.constvars, *jaxpr.invars)}
    for eqn in jaxpr.eqns:
        origin = moved_weight(eqn, origins)
        if origin is not None:
            origins.update((o, origin) for o in eqn.outvars)
    return origins


def moved_weight(eqn, origins: Mapping) -> tuple[int, int] | None:
    """The origin of an equation's outputs when it moves or assembles weights only (`origins`:
    the weights known, by value; flax's OptimizedLSTMCell concatenates its gates' kernels and
    biases), else None."""
    name = eqn.primitive.name
    if name not in MOVES and name not in ASSEMBLES:
        return None
    inputs = [a for a in eqn.invars if _is_var(a) and is_floating(a.aval)]
    if not inputs or not all(a in origins for a in inputs):
        return None
    return min(origins[a] for a in inputs)


def is_linear_layer(eqn, region: Region, weights) -> bool:
    """torch's linear and conv: a LOWER matmul without batch dimensions, or a convolution,
    whose right operand (the kernel) is among `weights`. Attention's batched score matmuls
    and products of two activations are not: a bias added to those is an activation (a mask)
    and promotes."""
    if not region.enabled or region.table.rule(eqn.primitive.name) != LOWER:
        return False
    kernel = eqn.invars[1] if len(eqn.invars) > 1 else None
    return (kernel is not None and _is_var(kernel) and kernel in weights
            and not jx.has_batch_dimensions(eqn))


def linear_kernels(jaxpr: jx.Jaxpr, regions: Sequence[Region]) -> dict[int, int]:
    """torch's `linear`, `conv` and `addmm` as a jaxpr writes them: each linear layer's
    matmul (`is_linear_layer`), by index, with the index of the `add` of its bias.

    torch adds the bias inside the layer's low-precision kernel. Here the kernel is the
    matmul, the moves of its result (flax reshapes nothing, but a batch of sequences is
    reshaped), and one `add` of a weight broadcast to the result, each reading the one before
    it alone, in one region.
    """
    eqns = jaxpr.eqns
    origins = weights(jaxpr)
    readers: dict = {}
    for k, eqn in enumerate(eqns):
        for v in eqn.invars:
            if _is_var(v):
                readers.setdefault(v, []).append(k)
    returned = {v for v in jaxpr.outvars if _is_var(v)}
    found = {}
    for i, eqn in enumerate(eqns):
        if (len(eqn.invars) != 2 or jx.asks_full_precision(eqn.params)
                or not is_linear_layer(eqn, regions[i], origins)):
            continue
        value = eqn.outvars[0]
        while len(readers.get(value, ())) == 1 and value not in returned:
            k = readers[value][0]
            nxt = eqns[k]
            if regions[k] != regions[i]:
                break
            name = nxt.primitive.name
            if name in MOVES and name != "convert_element_type":
                value = nxt.outvars[0]
                continue
            others = [v for v in nxt.invars if v is not value]
            if (name == "add" and len(others) == 1 and _is_var(others[0])
                    and others[0] in origins and _castable(others[0]) and _castable(value)
                    and was_broadcast(origins[others[0]], nxt.outvars[0])):
                found[i] = k
            break
    return found


def _starts_in_body(eqn, region: Region) -> tuple[bool, ...]:
    """For each input of a call (`jit`, custom_jvp, remat), whether a float32 chain inside
    starts from it: a nested jit is transparent, as if inlined (`jnp.linalg.norm(a - b)` of
    float16 values computes `a - b` in float32 where the norm is a float32 op)."""
    body = jx.call_body(eqn).jaxpr
    if len(body.invars) != len(eqn.invars):
        return (False,) * len(eqn.invars)
    return _body_starts(body, region)


@functools.lru_cache(maxsize=4096)
def _body_starts(body: jx.Jaxpr, region: Region) -> tuple[bool, ...]:
    regions = [region_of(region, e) for e in body.eqns]
    return _chains(body, regions)[1]


def _rule(eqn, region: Region):
    """The table's rule for an equation (a sum to one number has its own, see `OpTable`)."""
    return region.table.rule(eqn.primitive.name, sums_to_scalar(eqn))


def _is_seed(eqn, region: Region) -> bool:
    """A float32 op. A matmul written for full precision (jnp.linalg's composites ask for
    HIGHEST inside pinv, lstsq, solve, inv) is one too: torch's linear algebra kernels compute
    in float32 throughout."""
    if not region.enabled:
        return False
    rule = _rule(eqn, region)
    return rule in (FP32, FP32_STATISTICS) or (
        rule == LOWER and jx.asks_full_precision(eqn.params))


def normalization_kernels(jaxpr: jx.Jaxpr, regions: Sequence[Region], float32: frozenset[int]
                          ) -> tuple[frozenset[int], dict]:
    """The equations that finish a normalization in float32, and the kernels' results.

    torch's CPU normalization kernels (`layer_norm`, `group_norm`, `batch_norm`, `rms_norm`)
    read a bfloat16 activation and float32 parameters, compute in float32, and return bfloat16:
    one rounding, at the end. In a jaxpr, a normalization is a `FP32_STATISTICS` op (`rsqrt`)
    with the float32 chain that computes its statistics (see `float32_equations`); the kernel is
    the float32 equations joined to it, and the ops that finish the normalization from there:
    those that combine the kernel's values with its own inputs (`x - mean`), with smaller
    values (a scale, a shift, statistics) or with each other, and moves. An op that also reads
    another full-size value (a residual) or applies a function (an activation) is not part of
    it. A kernel's full-size results read outside it leave in the activation's dtype; its
    statistics (a running mean) stay float32.

    Returns:
      (the kernels' equations not already in `float32`, their exits (see `Plan.exits`)).
    """
    eqns = jaxpr.eqns
    forward = [not jx.is_backward(eqn) for eqn in eqns]
    seeds = [i for i in float32 if forward[i] and _rule(eqns[i], regions[i]) == FP32_STATISTICS]
    if not seeds:
        return frozenset(), {}
    producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
    parent = {i: i for i in float32 if forward[i]}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in parent:
        if _reads_half_activation(eqns[i]):
            # Where the kernel reads its activation (flax casts a bfloat16 input to float32
            # for the statistics): what produced the bfloat16 value, a cast to it included,
            # is outside, and the result leaves in that value's dtype.
            continue
        for v in eqns[i].invars:
            j = producer.get(v) if _is_var(v) else None
            if j in parent:
                parent[root(i)] = root(j)
    roots = {root(i) for i in seeds}
    kernel = {i for i in parent if root(i) in roots}
    produced = {v for i in kernel for v in eqns[i].outvars}
    entries = {v for i in kernel for v in eqns[i].invars
               if _is_var(v) and v not in produced and _castable(v)}
    origin = _origins(jaxpr)
    # The kernel's inputs, and values computed from them with smaller ones (flax's RMSNorm
    # subtracts a zero mean outside the statistics' chain): the other operand an op finishing
    # the normalization may read.
    near = set(entries)
    epilogue = set()
    for i, eqn in enumerate(eqns):
        name = eqn.primitive.name
        if (i in kernel or not forward[i] or not regions[i].enabled
                or name not in COMBINING and (name not in MOVES or name == "convert_element_type")):
            continue
        inputs = [v for v in eqn.invars if _is_var(v) and _castable(v)]
        out = eqn.outvars[0]
        own = [v for v in inputs if v in produced]
        # Statistics (or a scale made of them) applied to a full-size value make it the
        # activation being normalized: flax's BatchNorm in eval mode centres `x` by its
        # running mean outside the chain, then multiplies by `rsqrt(var) * scale`.
        applies = bool(own) and name in COMBINING and all(
            was_broadcast(origin.get(v), out) for v in own)
        if not applies and not all(
                v in produced or v in near or was_broadcast(origin.get(v), out) for v in inputs):
            continue
        if own:
            epilogue.add(i)
            produced.update(eqn.outvars)
            entries.update(v for v in inputs if v not in produced)
        elif any(v in near for v in inputs):
            near.update(eqn.outvars)
    kernel |= epilogue
    read_outside = {v for i, eqn in enumerate(eqns) if forward[i] and i not in kernel
                    for v in eqn.invars if _is_var(v)}
    read_outside.update(v for v in jaxpr.outvars if _is_var(v))
    # Values computed from an activation at its size (not statistics, nor a scale broadcast
    # from a statistic and a weight).
    derived = {e for e in entries if origin.get(e) == shape_key(e)}
    by_size: dict = {}
    for e in derived:
        by_size.setdefault(_size(e), []).append(e)
    exits = {}
    for i in sorted(kernel):
        for v in eqns[i].outvars:
            size = _size(v)
            if not any(_is_var(a) and a in derived and _size(a) == size
                       for a in eqns[i].invars):
                continue
            derived.add(v)
            if v not in read_outside or not _castable(v):
                continue
            # Of the kernel's inputs with its result's size, those of the highest rank: a
            # (1, D) activation, not the (D,) scale beside it.
            same = [e for e in by_size.get(size, ()) if producer.get(e, -1) < i]
            top = max((len(e.aval.shape) for e in same), default=0)
            activations = tuple(_moved_from(e, eqns, producer, float32) for e in same
                                if len(e.aval.shape) == top)
            if activations:
                exits[v] = activations
    return frozenset(epilogue - float32), exits


def _moved_from(var, eqns, producer: Mapping, float32: frozenset[int]):
    """The value the float32 chain moved (transposed, reshaped) into `var`, as the program
    holds it: a kernel that reads a bfloat16 value through a transpose reads it in float32
    from the transpose on, and returns the value's own dtype."""
    while _is_var(var) and (i := producer.get(var)) is not None and i in float32 and (
            eqns[i].primitive.name in SAME_VALUES):
        var = eqns[i].invars[0]
    return var


def _reads_half_activation(eqn) -> bool:
    """A cast of a half-precision value up to float32 (traced so)."""
    return (eqn.primitive.name == "convert_element_type"
            and is_half(eqn.invars[0].aval) and eqn.outvars[0].aval.dtype == FLOAT32)


def _origins(jaxpr: jx.Jaxpr) -> dict:
    """Each value's (size, rank) before it was moved or broadcast (a bias broadcast to an
    activation's shape is smaller there, or of lower rank); elementwise math keeps the largest
    of its operands' (a scale made of a broadcast variance and weight is still that small)."""
    origin = {v: shape_key(v) for v in (*jaxpr.constvars, *jaxpr.invars)}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        inputs = [origin[v] for v in eqn.invars if _is_var(v) and v in origin]
        for v in eqn.outvars:
            if name in MOVES:
                origin[v] = min(inputs, default=(1, 0))
            elif name in ELEMENTWISE and inputs:
                origin[v] = max(inputs)
            else:
                origin[v] = shape_key(v)
    return origin


def shape_key(var) -> tuple[int, int]:
    """A value's (size, rank): what an origin records (see `_origins`)."""
    return _size(var), len(getattr(var.aval, "shape", ()))


def was_broadcast(origin: tuple[int, int] | None, out) -> bool:
    """A value of this origin was broadcast to `out`'s shape: it had fewer elements or fewer
    dimensions (a (D,) scale applied to a (1, D) batch of one)."""
    if origin is None:
        return True
    size, rank = origin
    return size < _size(out) or rank < len(getattr(out.aval, "shape", ()))


def _size(var) -> int:
    return math.prod(getattr(var.aval, "shape", ()))


def sums_to_scalar(eqn) -> bool:
    """A reduction of arrays to one number: a loss's final mean, a trace, a dot product."""
    return (eqn.primitive.name in SUMS | DOT_PRODUCTS
            and all(not v.aval.shape for v in eqn.outvars)
            and any(_castable(v) and cast(jx.ShapedArray, v.aval).shape
                    for v in eqn.invars if _is_var(v)))


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
                and all(v in reduced or not cast(jx.ShapedArray, v.aval).shape for v in inputs)):
            reduced.update(eqn.outvars)
        elif name in CALLS:  # jnp.var and jnp.mean are jits
            body = jx.call_body(eqn).jaxpr
            inner = _statistics(body)
            reduced.update(o for o, b in zip(eqn.outvars, body.outvars, strict=True)
                           if b in inner)
    return frozenset(reduced)


def _is_var(atom) -> TypeGuard[jx.Var]:
    return not isinstance(atom, jx.Literal)


def _castable(var) -> bool:
    return is_castable(getattr(var.aval, "dtype", None))


# Ops a carry passes through unchanged in value on its way to being added to (a selection
# passes one of its operands, a scatter that sets the values it writes).
_PASSES = SAME_VALUES | {"select_n", "scatter"}


def accumulating_carries(body: jx.Jaxpr, carry_in: Sequence[int], carry_out: Sequence[int]
                         ) -> tuple[bool, ...]:
    """For each carry of a loop body (its input and output positions), whether the body adds
    to it: `y + dt * f(y)`, `total + x`, `t + dt`, a residual stream `x + attn(x) + mlp(...)`,
    masked (`jnp.where(m, c + d, c)`) or clipped. Such a carry keeps its traced dtype: carried
    in the low dtype, an accumulator stalls once its steps are below its precision. A carry
    scaled or gated before it is added to (an LSTM's `f * c + i * g`, an average `0.9 * c +
    x`) or replaced (`tanh(h @ w)`) is not one."""
    return tuple(_adds_to(body, body.outvars[o], {body.invars[i]}, _LOOKUP_DEPTH)
                 for i, o in zip(carry_in, carry_out, strict=True))


_LOOKUP_DEPTH = 32


def _retypes(eqn) -> bool:
    """A convert that only drops a weak type (jnp makes a weak carry strong before adding)."""
    return (eqn.primitive.name == "convert_element_type"
            and eqn.params["new_dtype"] == eqn.invars[0].aval.dtype)


def _adds_to(jaxpr: jx.Jaxpr, atom, carry: set, depth: int) -> bool:
    """Whether `atom` is a sum with `carry` among its terms: additions whose operands are
    `carry` or further additions, passed through moves, selections and nested calls (a call
    that only selects its inputs, as `jnp.where` and `jnp.clip` do, passes them on)."""
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}

    def root(a, steps=depth):
        while _is_var(a) and a not in carry and steps > 0:
            eqn = producers.get(a)
            if eqn is None or not (eqn.primitive.name in SAME_VALUES or _retypes(eqn)):
                return a
            a, steps = eqn.invars[0], steps - 1
        return a

    def floating(eqn):
        return [v for v in eqn.invars if _is_var(v) and is_floating(v.aval)]

    def visit(a, steps):
        if steps <= 0 or not _is_var(a):
            return False
        eqn = producers.get(a)
        if eqn is None:
            return False
        name = eqn.primitive.name
        if name in ADDS:
            return any(root(v) in carry or visit(v, steps - 1) for v in floating(eqn))
        if name in _PASSES or _retypes(eqn):
            return any(visit(v, steps - 1) for v in floating(eqn))
        if name in CALLS:
            body = jx.call_body(eqn).jaxpr
            if len(body.invars) != len(eqn.invars):
                return False
            out = body.outvars[eqn.outvars.index(a)]
            inner = {b for b, v in zip(body.invars, eqn.invars, strict=True)
                     if _is_var(v) and root(v) in carry}
            if inner and _adds_to(body, out, inner, steps - 1):
                return True
            # The body may pass an input through (a selection): go on outside from there.
            return any(visit(v, steps - 1) for b, v in zip(body.invars, eqn.invars, strict=True)
                       if _is_var(v) and is_floating(v.aval) and _passes(body, out, b, steps))
        return False

    return visit(atom, depth)


def _passes(jaxpr: jx.Jaxpr, atom, invar, depth: int) -> bool:
    """Whether `atom` may be `invar` passed through moves and selections (`jnp.where`'s
    body returns one of its inputs)."""
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    pending, seen = [atom], set()
    while pending and depth > 0:
        a = pending.pop()
        if a is invar:
            return True
        if not _is_var(a) or a in seen:
            continue
        seen.add(a)
        depth -= 1
        eqn = producers.get(a)
        if eqn is not None and (eqn.primitive.name in _PASSES | SELECTIONS
                                or _retypes(eqn)):
            pending.extend(v for v in eqn.invars if _is_var(v) and is_floating(v.aval))
    return False


__all__ = [
    "accumulating_carries", "float32_equations", "is_linear_layer", "kernel_exits",
    "kernel_reads", "kernel_runs", "KernelRun",
    "linear_kernels", "moved_weight", "normalization_kernels", "Plan", "plan", "shape_key",
    "sums_to_scalar", "was_broadcast", "weights"
]
