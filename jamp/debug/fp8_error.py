"""Which modules may go fp8: each module's fp8 error against float32, and the rules to keep the
modules fp8 hurts most in bfloat16 (`precision_report(..., fp8=recipe)`).

The program of `fn` runs once under `jax.jit` in float32. At each matmul and convolution inside
a module (a linen module's named scope, or a `jax.named_scope`), the product is computed a
second time with `jamp.fp8`'s float8 GEMM, on the same float32 operands: the difference is the
error fp8 adds in that layer alone, not compounded with the error of the layers before it. A
module's signal to noise ratio, in dB, is `-10 log10(mean(noise / signal))` over the rows of
its own matmuls' results (a token's features: the last dimension), noise and signal each
row's `sum((fp8 - exact)**2)` and `sum(exact**2)`, every iteration of a scan around them
included. Per row, so that a few tokens with large values (whose tensorwise scale pushes every
other token towards float8's subnormals) do not hide the error of the others.

e4m3's rounding alone costs a product about 25 to 30 dB; a module whose operands have outliers
(a tensorwise scale set by one large value pushes the rest towards float8's subnormals) or
whose values span more than float8's range measures lower. Modules below `FP8_MIN_SNR_DB` are
proposed in bfloat16.

Measured: the forward output GEMMs (the gradient GEMMs' operands, the output gradients, exist
only in a backward pass; their recipe casts are the forward's in e5m2 or rows). The delayed
recipe is measured at the scale its history settles to for steady amaxes, the current amax's:
tensorwise's. Matmuls inside `while` loops and `cond` branches are not measured.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jamp import _jax_internals as jx
from jamp import fp8
from jamp.policy.dtypes import FLOAT32, is_floating
from jamp.transforms.rules import equation_path, module_pattern
from jamp.walker import control_flow
from jamp.walker.evaluate import Env, Interpreter

# A module whose fp8 products keep less signal to noise than this (dB) stays in bfloat16:
# e4m3's rounding alone gives about 25 to 30 dB.
FP8_MIN_SNR_DB = 20.0


@dataclasses.dataclass(frozen=True)
class Fp8Error:
    """The fp8 error of one module's own matmuls and convolutions (forward output GEMMs).

    Attributes:
      module: its module path (`ByteGPT/Block_0/Dense_0`).
      path: the same as segments.
      snr_db: signal to noise ratio in dB of its products in fp8 against float32 (inf when
        fp8 is exact).
      gemms: its matmul and convolution equations measured.
      keep: True when fp8 hurts it enough (`snr_db` below `FP8_MIN_SNR_DB`) to keep it in
        bfloat16.
    """

    module: str
    path: tuple[str, ...]
    snr_db: float
    gemms: int
    keep: bool

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["path"] = list(self.path)
        # Strict JSON, as the rest of the report: a non-finite ratio as "inf" or "-inf".
        out["snr_db"] = self.snr_db if math.isfinite(self.snr_db) else str(self.snr_db)
        return out


def measure(fn: Callable, args: tuple, kwargs: dict, recipe: fp8.Recipe
            ) -> tuple[tuple[Fp8Error, ...], list]:
    """(each module's `Fp8Error`, worst first; the rules that keep the modules below
    `FP8_MIN_SNR_DB` in bfloat16 and put the others in `recipe`) of `fn(*args, **kwargs)`."""
    recipe = fp8.check_recipe(recipe, "fp8")
    measured = fp8.recipe("tensorwise") if recipe.scaling == "delayed" else recipe
    closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    flat = jax.tree_util.tree_leaves(args)
    interpreter = _Measure(measured)
    run = jax.jit(lambda consts, flat: interpreter.run(
        jx.ClosedJaxpr(closed.jaxpr, consts), flat)[1])
    errors = []
    for path, (ratios, rows) in jax.device_get(run(list(closed.consts), flat)).items():
        snr = math.inf if ratios == 0 or rows == 0 else -10 * math.log10(float(ratios / rows))
        errors.append(Fp8Error("/".join(path), path, snr, interpreter.counts[path],
                               snr < FP8_MIN_SNR_DB))
    errors.sort(key=lambda e: (e.snr_db, e.module))
    rules = [(module_pattern(e.path), jnp.bfloat16) for e in errors if e.keep]
    rules += [(module_pattern(e.path), recipe) for e in errors if not e.keep]
    return tuple(errors), rules


@dataclasses.dataclass
class _Level(Env):
    path: tuple[str, ...] = ()


class _Measure(Interpreter[_Level]):
    """Evaluates a float32 program; each module's matmuls add (the sum over result rows of
    noise / signal, the number of rows with signal) to the side results under its path."""

    def __init__(self, recipe: fp8.Recipe):
        self.recipe = recipe
        self.counts: dict[tuple[str, ...], int] = {}

    def new_env(self, closed: jx.ClosedJaxpr) -> _Level:
        return _Level()

    def _inner(self, env: _Level, eqn):
        path = equation_path(eqn, env.path)
        return self.body(lambda closed: _Level(path=path))

    def _call(self, env: _Level, eqn, invals: list) -> list:
        outs, extras = control_flow.call(eqn, invals, self._inner(env, eqn))
        _add(env.extras, extras)
        return outs

    def _scan(self, env: _Level, eqn, invals: list) -> list:
        outs, stacked = control_flow.scan(eqn, invals, self._inner(env, eqn))
        _add(env.extras, {k: jnp.sum(v, axis=0) for k, v in stacked.items()})
        return outs

    def _product(self, env: _Level, eqn, invals: list) -> list:
        exact = self.default(env, eqn, invals)
        path = equation_path(eqn, env.path)
        lhs, rhs = invals[:2]
        if not path or not (is_floating(lhs) and is_floating(rhs)):
            return exact
        lhs, rhs = (jnp.asarray(v, FLOAT32) for v in (lhs, rhs))
        params = eqn.params
        if eqn.primitive.name == "dot_general":
            low = fp8.dot_general(lhs, rhs, params["dimension_numbers"], self.recipe,
                                  preferred_element_type=FLOAT32)
        else:
            keep = ("window_strides", "padding", "lhs_dilation", "rhs_dilation",
                    "dimension_numbers", "feature_group_count", "batch_group_count")
            low = fp8.conv_general_dilated(lhs, rhs, **{k: params[k] for k in keep},
                                           recipe=self.recipe, preferred_element_type=FLOAT32)
        high = lax.convert_element_type(exact[0], FLOAT32)
        rows = high.reshape(-1, high.shape[-1]) if high.ndim else high.reshape(1, 1)
        signal = jnp.sum(rows ** 2, axis=-1)
        noise = jnp.sum((low.reshape(rows.shape) - rows) ** 2, axis=-1)
        ratio = jnp.where(signal > 0, noise / jnp.where(signal > 0, signal, 1.0), 0.0)
        _add(env.extras, {path: jnp.stack([jnp.sum(ratio),
                                           jnp.sum(signal > 0).astype(FLOAT32)])})
        self.counts[path] = self.counts.get(path, 0) + 1
        return exact

    rules = {**dict.fromkeys(control_flow.CALL_PRIMITIVES, _call), "scan": _scan,
             "dot_general": _product, "conv_general_dilated": _product}


def _add(into: dict, new: dict) -> None:
    for key, value in new.items():
        into[key] = into[key] + value if key in into else value


def table_lines(errors: tuple[Fp8Error, ...], rules: list, limit: int | None) -> list[str]:
    """The report's fp8 section: each module's signal to noise, worst first, and the rules."""
    lines = [f"fp8: signal to noise of each module's products against float32, worst first; "
             f"below {FP8_MIN_SNR_DB:g} dB stays in bfloat16"]
    for e in errors[:limit]:
        lines.append(f"  {e.snr_db:6.1f} dB  {e.module}  ({e.gemms} GEMMs)"
                     f"{'  -> bfloat16' if e.keep else ''}")
    if limit is not None and len(errors) > limit:
        lines.append(f"  ... {len(errors) - limit} more (row_limit)")
    lines.append("fp8 rules=[" + ", ".join(f"({p!r}, {_setting(s)})" for p, s in rules) + "]")
    return lines


def _setting(setting: Any) -> str:
    """A proposed rule's setting as code: the recipe, or bfloat16 (the only dtype proposed)."""
    return repr(setting) if isinstance(setting, fp8.Recipe) else "jnp.bfloat16"


__all__ = ["Fp8Error", "FP8_MIN_SNR_DB", "measure", "table_lines"]
