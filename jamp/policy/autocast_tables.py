"""Autocast's op tables: which lax primitive runs in which dtype, per device.

A table maps a primitive's name (`jax.extend.core.Primitive.name`, e.g. "dot_general") to its
rule:

- `LOWER`: floating inputs are cast to the autocast dtype (torch's "lower precision" list);
- `FP32`: floating inputs are cast to float32 (torch's "float32" list);
- `ACCUMULATE_FP32`: the op computes in float32 and its result is cast back to its inputs'
  dtype (torch's CPU kernels accumulate reduced-precision sums in float; jnp does the same for
  `jnp.sum` of half-precision arrays);
- `FP32_STATISTICS`: a normalization's statistics op (`rsqrt` of a variance): it computes in
  float32 with the chain that produces its operands, as `FP32`, and so does the rest of the
  normalization (centring, scaling, the affine weight and bias); the result leaves in the
  activation's dtype (torch's CPU normalization kernels: float32 inside, one rounding at the
  end);
- an explicit floating dtype (e.g. `np.dtype("float16")`): floating inputs are cast to it.

A primitive that is not in the table runs in the widest floating dtype among its current inputs
(torch's "promote" rule and its default for ops on no list). float64, integer, bool and complex
values are never cast, whatever the table says.

The defaults follow torch's autocast op reference for each device, mapped to the primitives that
`jax.numpy`, `jax.nn` and Flax emit:

- "cuda" (aliases "gpu" and "rocm"), float16 by default: matmuls and convolutions lower; the
  transcendental, power and reduction primitives behind torch's float32 list (softmax,
  log_softmax, layer_norm, the losses and norms are composites of these) in float32, and linear
  algebra and FFT, which have no half-precision kernels, in float32.
- "cpu", bfloat16 by default: matmuls and convolutions lower; torch's CPU float32 list maps to
  products, linear algebra and FFT. torch's CPU list has no `exp`, `log` or
  `sum`: softmax, log and exp of bfloat16 values stay in bfloat16, and sums return bfloat16
  (accumulated in float32, as torch's CPU kernels and jnp.sum do).
- "tpu", bfloat16 by default: torch has no TPU list in core; this table uses the CUDA lists
  (as torch_xla does), with bfloat16.

A table also holds *function rules* (`OpTable.functions`): library functions whose kernel torch's
lists name but that JAX writes as several primitives a jaxpr cannot tell from other code
(`optax.ctc_loss`'s one-hot matmuls, `jnp.quantile`'s sort and interpolation, optax's losses left
unreduced, `scalar / x`, flax's `PReLU`). autocast matches them by the function on each
equation's traceback and runs what they compute with the setting given (see `jamp.autocast`'s
`rules=`), after the user's own rules: most are one `Kernel` of torch's list.

Extend or override a table with `OpTable.updated` / `OpTable.without` and pass it to
`jamp.autocast(..., op_table=...)`:

    table = jamp.policy.autocast_table("cuda").updated(
        {"logistic": FP32, "dot_general": "bfloat16"})
    loss = jamp.autocast(loss_fn, device_type="cuda", op_table=table)

This module is data and the checks of it. It uses no JAX internals (of `jax.extend.core` only
the `Primitive` type), and of jamp only `primitives` (the names its keys are checked against)
and `dtypes` (the floating dtypes a rule or a default may name).
"""

from __future__ import annotations

import dataclasses
import functools
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Union

import jax.numpy as jnp
import numpy as np

from jax.extend import core as jex_core

from jamp.policy import primitives
from jamp.policy.dtypes import AUTOCAST_DTYPES, canonical_floating_dtype

LOWER = "lower"
FP32 = "fp32"
ACCUMULATE_FP32 = "accumulate_fp32"
FP32_STATISTICS = "fp32_statistics"

# The named rules (a rule may also be a floating dtype).
RULES = (LOWER, FP32, ACCUMULATE_FP32, FP32_STATISTICS)

Rule = Union[str, np.dtype]

# What a precision rule (`jamp.autocast(..., rules=...)`, `OpTable.functions`) sets for the
# equations it matches: a dtype autocast can use, `OFF` (autocast off: the program's own
# dtypes), `ON` (the transform's own dtype and table, no rule: an exception carved out of a
# wider rule), an `OpTable`, op rules to change in the table that applies (`OpRules`), or a
# `Kernel` of one of torch's lists.
OFF = "off"
ON = "on"
# The dtypes autocast can use, named in torch's order (float16, bfloat16, float32).
_ACCEPTED = ", ".join(d.name for d in sorted(AUTOCAST_DTYPES,
                                              key=lambda d: (d.itemsize, d.name[0] == "b")))
Setting = Union[str, np.dtype, "OpTable", "OpRules", "Kernel"]

# torch: __matmul__ addbmm addmm addmv addr baddbmm bmm chain_matmul multi_dot mm mv linear matmul
# prelu (its matmul), conv*/conv_transpose*, RNN cells (their matmuls); scaled_dot_product_attention
# and multi-head attention are matmuls too. jnp.dot, tensordot, einsum, inner, vdot and outer all
# trace to dot_general, so they lower as well (torch promotes `dot` and `tensordot`).
_LOWER_OPS = tuple(sorted(primitives.MATMULS))

# torch CUDA float32 list -> primitives. pow/__pow__/__rpow__/reciprocal -> pow and integer_pow
# (what `x ** 2` and `jnp.reciprocal` trace to; jax.nn.gelu's tanh form is built on x ** 3, which
# torch runs as one low-precision kernel: a function rule keeps it so); square (`jnp.square`) is
# left to promotion; __rdiv__/__rtruediv__ on a tensor -> div, left to promotion (it also
# implements ordinary division, which torch does not upcast; `scalar / x` is matched by a
# function rule instead); rsqrt; exp,
# expm1, log, log1p, log2 (its own primitive since jax 0.12; before it, log + div), log10
# (log + div); acos, asin, cosh, sinh, tan; erfinv; sum, prod,
# cumsum, cumprod; softmax/log_softmax/layer_norm/group_norm/norm/normalize/losses are built from
# these, so they run in float32 exactly where torch's do.
_CUDA_FP32_OPS = (
    "exp", "exp2", "expm1", "log", "log1p", "log2", "pow", "integer_pow", "rsqrt",
    "acos", "asin", "cosh", "sinh", "tan", "erf_inv",
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
)

# torch CPU float32 list -> primitives: prod (not cumprod: torch returns bfloat16 for it), the
# linear algebra (cholesky*, inverse, lu_solve, qr, ormqr, svd, eig*, triangular_solve, lstsq,
# ...) and fft_*. The losses on the CPU list are chains ending in a sum to one number (the cpu
# table's `scalar_results`). The same linear algebra and FFT
# are float32 on the cuda and tpu tables too: LAPACK, cuSOLVER and XLA's FFT have no half
# precision kernels (torch's CUDA autocast leaves them off its lists and raises for float16).
_LINALG_FFT_OPS = (
    "cholesky", "cholesky_update", "triangular_solve", "lu", "qr", "householder_product",
    "ormqr", "geqrf", "svd", "eigh", "eig", "schur", "hessenberg", "tridiagonal",
    "tridiagonal_solve", "fft",
)
# rsqrt is where every normalization (BatchNorm, LayerNorm, GroupNorm, RMSNorm, in Flax and by
# hand) turns its statistics into a scale. torch's norm kernels compute those statistics in
# float32 on every device, whatever their input dtype; listing rsqrt makes the interpreter
# compute the whole chain that feeds it (mean, mean of squares, variance) in float32 too. On
# the cuda table it is FP32 (torch's CUDA list holds rsqrt, layer_norm and group_norm: float32
# results); on the cpu table FP32_STATISTICS: torch's CPU norm kernels return the input's dtype.
_NORM_STATISTICS_OPS = ("rsqrt",)
_CPU_FP32_OPS = ("reduce_prod",) + _LINALG_FFT_OPS

# torch's CPU sum/cumsum of bfloat16 return bfloat16 but accumulate in float (acc_type).
_CPU_ACCUMULATE_OPS = ("reduce_sum", "cumsum")


@dataclasses.dataclass(frozen=True)
class OpTable:
    """One device's autocast op table.

    Attributes:
      device_type: "cuda", "cpu" or "tpu" (the canonical names; "gpu" and "rocm" are
        aliases of "cuda").
      default_dtype: the autocast dtype when `jamp.autocast` is given none.
      rules: primitive name -> `LOWER`, `FP32`, `ACCUMULATE_FP32` or an explicit floating
        dtype. Read-only. Keys may also be `jax.extend.core.Primitive` objects (stored by
        name); a name that is no JAX primitive (torch's "softmax", a typo) is a ValueError
        that says what the torch op traces to.
      scalar_results: the rule of a sum that reduces arrays to one number (a `reduce_sum`
        with a rank-0 result: a loss's mean, a trace), whatever its primitive's rule says;
        None: its primitive's rule. The cpu table sets `FP32`: torch's CPU float32 list holds
        the losses (cross entropy, NLL, BCE, margin losses...) and `trace`, kernels that sum a
        batch to one number in float32, and in a jaxpr each is a chain ending in such a sum.
        A product of two vectors to one number (a `dot_general` with a rank-0 result: torch's
        `dot`, `vdot`, `inner`, which are on no list) is no matrix product: `LOWER` does not
        apply to it, and it runs in its inputs' dtypes.
      functions: function rules, `(qualified function name, setting)` pairs in order (see
        `check_setting` for the settings): what the equations traced inside that function
        compute with, whatever the primitives' rules say. autocast applies them after the
        rules the user passes to `jamp.autocast(..., rules=...)`. A name that does not resolve
        in the running versions of the libraries is skipped.
    """

    device_type: str
    default_dtype: np.dtype
    rules: Mapping[str, Rule]
    scalar_results: Rule | None = None
    functions: tuple[tuple[str, Setting], ...] = ()

    def __post_init__(self):
        given = dict(self.rules)
        rules = {_primitive_name(name): rule for name, rule in given.items()}
        _check_names(given)
        checked = {name: _check_rule(name, rule) for name, rule in rules.items()}
        object.__setattr__(self, "rules", MappingProxyType(checked))
        object.__setattr__(self, "default_dtype",
                           canonical_floating_dtype(self.default_dtype, "default_dtype"))
        # Tables key caches of the autocast interpreter: hash once.
        if self.scalar_results is not None:
            object.__setattr__(self, "scalar_results",
                               _check_rule("scalar_results", self.scalar_results))
        object.__setattr__(self, "functions", _check_functions(self.functions))
        object.__setattr__(self, "_hash", hash((self.device_type, self.default_dtype, tuple(
            sorted((k, str(v)) for k, v in checked.items())), str(self.scalar_results),
            self.functions)))

    def rule(self, primitive_name: str, scalar_result: bool = False) -> Rule | None:
        """The rule of a primitive, or None when it runs in its inputs' widest floating dtype.

        `scalar_result`: the equation reduces arrays to one number (see `scalar_results`)."""
        rule = self.rules.get(primitive_name)
        if scalar_result:
            if primitive_name in primitives.SUMS and self.scalar_results is not None:
                return self.scalar_results
            if rule == LOWER:
                return None
        return rule

    def updated(self, rules: Mapping[str, Rule]) -> "OpTable":
        """A copy with `rules` added or replacing the existing ones (add a primitive, move it
        from one list to the other, or pin its dtype)."""
        return dataclasses.replace(self, rules={**self.rules, **rules})

    def without(self, *primitive_names: str) -> "OpTable":
        """A copy in which the named primitives follow their inputs (torch's promote rule)."""
        _check_names(primitive_names)
        primitive_names = tuple(map(_primitive_name, primitive_names))
        return dataclasses.replace(
            self, rules={k: v for k, v in self.rules.items() if k not in primitive_names})

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or isinstance(other, OpTable) and self._hash == other._hash and (
            self.device_type, self.default_dtype, dict(self.rules), self.scalar_results,
            self.functions) == (other.device_type, other.default_dtype, dict(other.rules),
                                other.scalar_results, other.functions)


def _primitive_name(key) -> str:
    # A Primitive object stands for its name (the way to list a primitive of your own).
    return key.name if isinstance(key, jex_core.Primitive) else key


def _check_names(names: Iterable[Any]) -> None:
    # A Primitive object given as a key is a primitive, wherever it was made.
    names = [name for name in names if not isinstance(name, jex_core.Primitive)]
    bad = [name for name in names if not isinstance(name, str)]
    if bad:
        raise TypeError(
            f"Op table keys must be primitive names (str) or jax.extend.core.Primitive "
            f"objects; got {', '.join(map(repr, bad))}.")
    unknown = primitives.unknown_names(names)
    if unknown:
        one = len(unknown) == 1
        raise ValueError(" ".join([
            f"Op table names {', '.join(map(repr, unknown))}, which",
            f"{'is not a JAX primitive' if one else 'are not JAX primitives'}: a rule for",
            f"{'it' if one else 'them'} would match nothing.",
            *filter(None, map(primitives.unknown_name_hint, unknown)),
            primitives.LIST_PRIMITIVES_HINT]))


def _check_rule(name: str, rule: Rule) -> Rule:
    if isinstance(rule, str) and rule in RULES:
        return rule
    try:
        return canonical_floating_dtype(rule, f"rule for {name!r}")
    except ValueError as e:
        raise ValueError(
            f"{e} The rule for {name!r} must be one of {', '.join(map(repr, RULES))} or a "
            "floating dtype.") from None


@dataclasses.dataclass(frozen=True)
class OpRules:
    """A precision rule's changes to the op table that applies where it matches, given as a
    dict `{primitive name: rule}` (a rule of `RULES`, a floating dtype, or None to drop the
    primitive from the table, so that it follows its inputs).

    Attributes:
      changes: the (primitive name, rule or None) pairs, sorted by name.
    """

    changes: tuple[tuple[str, Rule | None], ...]

    @classmethod
    def of(cls, rules: Mapping[Any, Any]) -> "OpRules":
        _check_names(rules)
        return cls(tuple(sorted(
            (_primitive_name(name), None if rule is None else _check_rule(name, rule))
            for name, rule in rules.items())))

    def applied_to(self, table: "OpTable") -> "OpTable":
        return _applied(self, table)


@functools.lru_cache(maxsize=256)
def _applied(rules: OpRules, table: "OpTable") -> "OpTable":
    dropped = [name for name, rule in rules.changes if rule is None]
    return table.updated({name: rule for name, rule in rules.changes if rule is not None}
                         ).without(*dropped)


# A kernel that casts its inputs to their promoted dtype before it computes (`Kernel`).
PROMOTE = "promote"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A function that is one torch kernel (a function rule's setting).

    torch casts a listed kernel's floating inputs to the list's dtype, whatever dtype they
    have, and the kernel returns that dtype; some kernels on no list cast their inputs to
    their promoted dtype first. JAX libraries write such a kernel (`jnp.quantile`,
    `optax.sigmoid_binary_cross_entropy`, flax's `PReLU`) as several primitives, casting
    their inputs to one another's dtype and their result back to their inputs'. Where the
    function matches, every floating input of every op it computes is cast to the kernel's
    dtype, and its own casts between autocast's dtypes give that dtype.

    Attributes:
      rule: `FP32` (float32), `LOWER` (the autocast dtype that applies) or `PROMOTE` (the
        widest dtype among the floating values the function reads, Python scalars aside).
      rounded: the function's results leave it rounded once to the widest dtype among the
        floating values it reads (Python scalars aside), not in the dtype it computes in:
        torch's CPU `gelu` and `softmax` compute a bfloat16 input in float32 inside and
        return bfloat16 (`Kernel(FP32, rounded=True)`).
    """

    rule: str
    rounded: bool = False

    def __post_init__(self):
        if self.rule not in (FP32, LOWER, PROMOTE):
            raise ValueError(f"Kernel rule {self.rule!r}: expected {FP32!r}, {LOWER!r} or "
                             f"{PROMOTE!r}.")


def check_autocast_dtype(dtype) -> np.dtype:
    """Validates an autocast dtype: float16, bfloat16 or float32.

    Raises:
      ValueError: naming the value and the accepted dtypes.
    """
    accepted = _ACCEPTED
    try:
        result = canonical_floating_dtype(dtype, "dtype")
    except ValueError:
        raise ValueError(
            f"autocast dtype={dtype!r} is not a floating dtype autocast can use: expected one "
            f"of {accepted}.") from None
    if result not in AUTOCAST_DTYPES:
        raise ValueError(
            f"autocast dtype={dtype!r} is not supported: expected one of {accepted} "
            "(float64 values are never cast by autocast).")
    return result


def check_setting(setting: Any, rule: Any) -> Setting:
    """Validates what a precision rule sets: a dtype autocast can use (any spelling, returned as
    a numpy dtype), "off", "on", an `OpTable`, a `Kernel`, or a dict of op rules (returned as
    `OpRules`).

    Raises:
      ValueError: naming the rule, the value and the accepted forms (a dict's bad primitive
        name or rule as `OpTable` names them).
    """
    if isinstance(setting, (OpTable, OpRules, Kernel)) or (isinstance(setting, str)
                                                   and setting in (OFF, ON)):
        return setting
    if isinstance(setting, Mapping):
        return OpRules.of(setting)
    try:
        return check_autocast_dtype(setting)
    except ValueError:
        raise ValueError(
            f"Precision rule {rule!r} sets {setting!r}: expected a dtype autocast can use "
            f"({_ACCEPTED}), {OFF!r} (autocast off: the program's own "
            f"dtypes), {ON!r} (the transform's own dtype and op table), a "
            "jamp.policy.OpTable, or a dict of op rules to change in the table "
            "({'exp': FP32}).") from None


def _check_functions(functions) -> tuple[tuple[str, Setting], ...]:
    pairs = tuple(map(tuple, functions))
    for pair in pairs:
        if len(pair) != 2 or not isinstance(pair[0], str):
            raise TypeError(f"OpTable functions are (qualified function name, setting) pairs; "
                            f"got {pair!r}.")
    return tuple((name, check_setting(setting, (name, setting))) for name, setting in pairs)


def _table(device_type: str, dtype, fp32_ops, accumulate_ops=(), statistics_ops=(),
           scalar_results=None, functions=()) -> OpTable:
    rules = {**{name: LOWER for name in _LOWER_OPS}, **{name: FP32 for name in fp32_ops},
             **{name: ACCUMULATE_FP32 for name in accumulate_ops},
             **{name: FP32_STATISTICS for name in statistics_ops}}
    return OpTable(device_type, np.dtype(dtype), rules, scalar_results, functions)


# Function rules: library functions whose kernel torch's lists name but that JAX writes as
# several primitives, matched by the function on an equation's traceback.
_FLOAT32_KERNEL = Kernel(FP32)
_LOWER_KERNEL = Kernel(LOWER)
# torch's float32 lists (CPU and CUDA) hold the losses, reduced or not: optax's losses are
# float32 kernels (a sum to one number, `scalar_results`, catches only the reduced ones;
# optax's CTC alignment is one-hot matmuls, which would lower). torch's lower-precision lists
# hold prelu, which flax writes as a select of a product: no matmul says so.
_LIST_FUNCTIONS = tuple((f"optax.losses.{name}", _FLOAT32_KERNEL) for name in (
    "ctc_loss", "ctc_loss_with_forward_probs", "sigmoid_binary_cross_entropy",
    "softmax_cross_entropy", "softmax_cross_entropy_with_integer_labels",
    "safe_softmax_cross_entropy", "kl_divergence", "kl_divergence_with_log_targets",
    "huber_loss", "squared_error", "l2_loss", "hinge_loss", "multiclass_hinge_loss",
    "triplet_margin_loss")) + (
    ("flax.linen.PReLU", _LOWER_KERNEL), ("flax.nnx.PReLU", _LOWER_KERNEL))
# torch's CPU kernels for ops on no list compute a bfloat16 input in float32 and round their
# result once; jax.nn writes gelu (its 1/sqrt(2) a constant the program holds in float32) and
# softmax as chains of primitives that would each round.
_ROUNDED_ONCE = tuple((name, Kernel(FP32, rounded=True))
                      for name in ("jax.nn.gelu", "jax.nn.softmax"))
# torch's CPU float32 list: quantile and nanquantile (a sort and an interpolation in JAX), the
# reflection and replication pads (jnp.pad in any mode: a rule names a function, not its
# arguments). cosine_similarity is on no CPU list, but torch's kernel promotes its inputs before
# it computes, not each input's norm on its own dtype.
_CPU_FUNCTIONS = _LIST_FUNCTIONS + (
    ("jax.numpy.quantile", _FLOAT32_KERNEL), ("jax.numpy.nanquantile", _FLOAT32_KERNEL),
    ("jax.numpy.pad", _FLOAT32_KERNEL), ("optax.losses.cosine_similarity", Kernel(PROMOTE)),
) + _ROUNDED_ONCE
# torch's CUDA float32 list: __rtruediv__ (`scalar / x`: a `div`, which also implements
# ordinary division) and cosine_similarity. jax.nn.gelu's tanh form is built on `x ** 3`, and
# torch runs gelu as one low-precision kernel: there `integer_pow` follows its input.
_CUDA_FUNCTIONS = (("jax.nn.gelu", OpRules.of({"integer_pow": None})),) + _LIST_FUNCTIONS + (
    ("jax.Array.__rtruediv__", _FLOAT32_KERNEL),
    ("optax.losses.cosine_similarity", _FLOAT32_KERNEL),
)

DEFAULT_TABLES: Mapping[str, OpTable] = MappingProxyType({
    "cuda": _table("cuda", jnp.float16, _CUDA_FP32_OPS + _LINALG_FFT_OPS,
                   functions=_CUDA_FUNCTIONS),
    "cpu": _table("cpu", jnp.bfloat16, _CPU_FP32_OPS, _CPU_ACCUMULATE_OPS, _NORM_STATISTICS_OPS,
                  scalar_results=FP32, functions=_CPU_FUNCTIONS),
    "tpu": _table("tpu", jnp.bfloat16, _CUDA_FP32_OPS + _LINALG_FFT_OPS,
                  functions=_CUDA_FUNCTIONS),
})

# Other names of a device type: "gpu" is what `jax.default_backend()` says on any GPU, and
# "rocm" is AMD's platform name; both select the cuda table, as torch's autocast does on ROCm.
DEVICE_ALIASES: Mapping[str, str] = MappingProxyType({"gpu": "cuda", "rocm": "cuda"})

# Every spelling `canonical_device_type` accepts, each table's aliases after its name: the one
# list that error messages and documentation name.
ACCEPTED_DEVICE_TYPES: tuple[str, ...] = tuple(
    name for table in DEFAULT_TABLES
    for name in (table, *(alias for alias, to in DEVICE_ALIASES.items() if to == table)))


def canonical_device_type(device_type: str) -> str:
    """"cuda", "cpu" or "tpu" for any accepted spelling ("gpu" and "rocm" -> "cuda"); case
    and surrounding spaces are ignored.

    Raises:
      TypeError: for a device type that is not a string.
      ValueError: naming the unknown device type, as written, and the accepted ones.
    """
    if not isinstance(device_type, str):
        raise TypeError(
            f"autocast device_type must be a string, one of {_accepted_device_types()}; got "
            f"device_type={device_type!r} of type {type(device_type).__name__}.")
    key = device_type.strip().lower()
    key = DEVICE_ALIASES.get(key, key)
    if key not in DEFAULT_TABLES:
        raise ValueError(
            f"Unknown autocast device_type {device_type!r}: expected one of "
            f"{_accepted_device_types()}.")
    return key


def _accepted_device_types() -> str:
    return ", ".join(map(repr, ACCEPTED_DEVICE_TYPES))


def autocast_table(device_type: str) -> OpTable:
    """The default op table of a device type ("cuda" or its aliases "gpu" and "rocm", "cpu",
    "tpu")."""
    return DEFAULT_TABLES[canonical_device_type(device_type)]


__all__ = [
    "ACCEPTED_DEVICE_TYPES", "ACCUMULATE_FP32", "autocast_table", "canonical_device_type",
    "check_autocast_dtype", "check_setting", "DEFAULT_TABLES", "DEVICE_ALIASES", "FP32",
    "FP32_STATISTICS", "Kernel", "LOWER", "OFF", "ON", "OpRules", "OpTable", "PROMOTE", "Rule",
    "RULES", "Setting"
]
