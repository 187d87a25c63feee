"""Op-by-op parity of jamp's autocast with torch's, measured live.

Each `Case` is one torch op and the JAX code a user writes for it. It is run twice: with float32
inputs, and with a low-precision input mixed in (the first floating input, or those a case names,
in bfloat16: a value autocast lowered, or one the program typed so). torch runs it under
`torch.autocast("cpu", dtype=torch.bfloat16)`; jamp runs the JAX code under
`jamp.autocast(..., device_type="cpu")`. They agree when

1. every output has torch's dtype, and
2. the transformed program computes no floating op in a dtype narrower than the one torch's
   kernel computes in: float32 for torch's float32 list (the inner matmuls of `pinv` and the
   `x - max` of a loss included), the output's dtype otherwise. Half-precision sums that
   accumulate in float32 are wider, not narrower, and pass; and
3. for torch's lower-precision list, the matmuls and convolutions run in bfloat16 (every op,
   in a kernel that has none: prelu).

The dtypes an op "computes in" are read from the transformed jaxpr: the floating input dtypes of
each equation that computes values from data (moves, converts and arithmetic on literals alone
excluded), sub-jaxprs included.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jamp
from jamp import _jax_internals as jx
from jamp.policy import primitives
from jamp.policy.dtypes import is_floating, is_inexact
from jamp.walker.walk import equations

LOW = "bfloat16"
# torch's lists (shared/reference/autocast-ops.md, CPU), and ops on none of them.
LISTS = ("lower", "fp32", "none")
VARIANTS = ("float32", "mixed")

# Equations that move values rather than compute them: the table's moves and assemblies, and
# those that place, select or make values without arithmetic.
_MOVES = primitives.MOVES | primitives.ASSEMBLES | frozenset({
    "pad", "gather", "dynamic_update_slice", "select_n", "stop_gradient", "iota",
    "sharding_constraint",
})
INPUT_SCOPE = "parity_lowered_input"


@dataclasses.dataclass(frozen=True)
class Case:
    """One torch op and its JAX counterpart.

    Attributes:
      name: the op as torch's list names it (or a common name for ops on none).
      list: "lower", "fp32" or "none": where torch's CPU autocast puts it.
      torch_fn: takes `torch` and the torch inputs.
      jax_fn: takes the JAX inputs (the same positions).
      inputs: numpy values made from a seeded generator: float32 arrays are the floating inputs,
        integer arrays are passed as int64 (torch) / int32 (JAX), other values as they are.
      low: positions of the floating inputs made bfloat16 in the "mixed" variant (default: the
        first floating input).
      cuda: where torch's CUDA autocast puts it: "lower", "fp32", "promote" or "none".
      typed: the "mixed" variant's low inputs are bfloat16 in the program's own types (a
        user's cast, a bfloat16 argument), not values autocast lowered.
    """

    name: str
    list: str
    torch_fn: Callable
    jax_fn: Callable
    inputs: Callable[[np.random.Generator], Sequence[Any]]
    low: tuple[int, ...] | None = None
    cuda: str = "none"
    typed: bool = False


@dataclasses.dataclass(frozen=True)
class Verdict:
    case: str
    variant: str
    agree: bool | None  # None: torch refuses the inputs (no verdict)
    why: str = ""

    @property
    def key(self) -> str:
        return f"{self.case}[{self.variant}]"


def _low_positions(case: Case, values) -> tuple[int, ...]:
    if case.low is not None:
        return case.low
    floating = [i for i, v in enumerate(values) if _is_float_array(v)]
    return tuple(floating[:1])


def _is_float_array(v) -> bool:
    return isinstance(v, np.ndarray) and v.dtype == np.float32


def _is_int_array(v) -> bool:
    return isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.integer)


def torch_dtypes(case: Case, variant: str) -> tuple[str, ...] | None:
    """torch's output dtypes under CPU autocast, or None when torch refuses the inputs."""
    import torch

    values = case.inputs(np.random.default_rng(0))
    low = _low_positions(case, values) if variant == "mixed" else ()
    args = []
    for i, v in enumerate(values):
        if _is_float_array(v):
            t = torch.from_numpy(v.copy())
            args.append(t.bfloat16() if i in low else t)
        elif _is_int_array(v):
            args.append(torch.from_numpy(v.astype(np.int64)))
        else:
            args.append(v)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = case.torch_fn(torch, *args)
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(str(o.dtype).removeprefix("torch.") for o in outs
                 if torch.is_tensor(o) and (o.is_floating_point() or o.is_complex()))


def jax_args(case: Case) -> tuple[list[Any], tuple[int, ...]]:
    """The JAX arguments (floating ones in float32), and the positions the mixed variant
    lowers."""
    values = case.inputs(np.random.default_rng(0))
    args = []
    for v in values:
        if _is_float_array(v):
            args.append(jnp.asarray(v, jnp.float32))
        elif _is_int_array(v):
            args.append(jnp.asarray(v, jnp.int32))
        else:
            args.append(v)
    return args, _low_positions(case, values)


def _lowered(x):
    """`x` in bfloat16, as autocast's matmuls leave activations: a low value of a float32
    program (marked, so that this matmul is not counted as part of the op)."""
    with jax.named_scope(INPUT_SCOPE):
        flat = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
        return (flat @ jnp.eye(flat.shape[-1], dtype=x.dtype)).reshape(x.shape)


def transformed_jaxpr(case: Case, variant: str, device_type: str = "cpu"):
    """The jaxpr of the JAX code under autocast.

    In the mixed variant the low inputs are made bfloat16 by autocast itself, inside the
    program, as a model's activations are: torch's autocast sees the same bfloat16 tensor
    whether a lowered op or `.bfloat16()` made it, and jamp decides on the traced program,
    in which a value the user casts is typed by jnp's own rules (see docs/autocast.md). A
    `typed` case casts them in the program instead.
    """
    args, low = jax_args(case)
    low = low if variant == "mixed" else ()
    arrays = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]

    def f(*array_args):
        full = list(args)
        for i, a in zip(arrays, array_args):
            full[i] = a if i not in low else a.astype(LOW) if case.typed else _lowered(a)
        return case.jax_fn(*full)

    g = jamp.autocast(f, device_type=device_type, cast_outputs=False)
    return jax.make_jaxpr(g)(*[args[i] for i in arrays])


def computed_in(closed) -> list[tuple[str, tuple[str, ...]]]:
    """(primitive, floating input dtypes) of every equation that computes floating values."""
    found = []
    for eqn in equations(closed):
        if jx.bodies(eqn) or eqn.primitive.name in _MOVES or INPUT_SCOPE in str(
                eqn.source_info.name_stack):
            continue
        if not any(is_floating(v.aval) for v in eqn.outvars):
            continue
        dtypes = tuple(np.dtype(v.aval.dtype).name for v in eqn.invars if is_floating(v.aval))
        # Literals alone (a tolerance jnp derives from the input dtype's eps) are no data.
        if dtypes and not all(isinstance(v, jax.extend.core.Literal) for v in eqn.invars):
            found.append((eqn.primitive.name, dtypes))
    return found


def _narrower(dtype: str, than: str) -> bool:
    a, b = jnp.finfo(dtype), jnp.finfo(than)
    return a.bits < b.bits or (a.bits == b.bits and dtype != than)


def _below(ops, floor: str) -> list[str]:
    """The equations of `ops` (see `computed_in`) that compute narrower than `floor`."""
    return sorted({f"{p}{list(d)}" for p, d in ops if any(_narrower(x, floor) for x in d)})


def verdict(case: Case, variant: str) -> Verdict:
    want = torch_dtypes(case, variant)
    if want is None:
        return Verdict(case.name, variant, None, "torch refuses these inputs")
    closed = transformed_jaxpr(case, variant)
    got = tuple(np.dtype(a.dtype).name for a in closed.out_avals
                if is_inexact(a))
    if got != want:
        return Verdict(case.name, variant, False, f"outputs {got}, torch {want}")
    floor = "float32" if case.list == "fp32" else min(
        (w for w in want if w in ("bfloat16", "float16", "float32")),
        key=lambda w: jnp.finfo(w).bits, default="float32")
    ops = computed_in(closed)
    narrow = _below(ops, floor)
    if narrow:
        return Verdict(case.name, variant, False, f"computes below {floor}: {', '.join(narrow)}")
    if case.list == "lower":
        kernel = [(p, d) for p, d in ops if p in primitives.MATMULS] or ops
        wide = sorted({f"{p}{list(d)}" for p, d in kernel if any(x != LOW for x in d)})
        if wide or not kernel:
            return Verdict(case.name, variant, False,
                           f"kernel not in {LOW}: {', '.join(wide) or 'none found'}")
    return Verdict(case.name, variant, True)


def verdicts(cases: Sequence[Case]) -> list[Verdict]:
    return [verdict(c, v) for c in cases for v in VARIANTS]


def cuda_verdict(case: Case, variant: str) -> Verdict:
    """The cuda table against torch's CUDA lists: an op on the float32 list computes every
    floating op in float32; an op on the lower list returns float16."""
    closed = transformed_jaxpr(case, variant, device_type="cuda")
    if case.cuda == "fp32":
        narrow = _below(computed_in(closed), "float32")
        if narrow:
            return Verdict(case.name, variant, False,
                           f"computes below float32: {', '.join(narrow)}")
    elif case.cuda == "lower":
        got = tuple(np.dtype(a.dtype).name for a in closed.out_avals if is_floating(a))
        if set(got) != {"float16"}:
            return Verdict(case.name, variant, False, f"outputs {got}, want float16")
    return Verdict(case.name, variant, True)


def cuda_verdicts(cases: Sequence[Case]) -> list[Verdict]:
    return [cuda_verdict(c, v) for c in cases if c.cuda in ("fp32", "lower") for v in VARIANTS]
