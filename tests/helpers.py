"""What test modules across the suite share: dtype names, the small float32 inputs, comparisons
of results and trees, readers of the dtypes a program computes in (from its jaxpr or its
lowered StableHLO), and the skip of a test whose example needs the `examples` extra.

Test modules import it as `helpers`: pytest's `pythonpath` setting (pyproject.toml) puts tests/
on the path.
"""

import importlib.util
import re
from collections.abc import Iterator

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp.walker.walk import equations

BF16, F16, F32, F64 = (np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64))

# Apex's documented dtypes per opt level, as jamp.initialize sets them up (linen and NNX):
# (kernels, batch-norm params, batch stats, masters, matmuls).
OPT_LEVEL_DTYPES = {
    "O0": (F32, F32, F32, None, "f32"),
    "O1": (F32, F32, F32, None, "f16"),
    "O2": (F16, F32, F32, F32, "f16"),
    "O3": (F16, F16, F16, None, "f16"),
}

# An activation and a weight: float32, mixed signs, products well inside float16's range.
X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
W = jnp.linspace(0.5, -0.5, 16, dtype=jnp.float32).reshape(4, 4)


def needs_examples_extra(*modules: str):
    """A mark that skips a test where one of `modules`, which the `examples` extra installs
    (tqdm, sklearn, matplotlib), is missing, saying which and how to install it."""
    missing = [m for m in modules if not _installed(m)]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}, which the "
                                                    f"examples extra installs: "
                                                    f"pip install -e '.[examples]'")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def rel_err(got, want) -> float:
    """‖got - want‖ / ‖want‖, both read as float32."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def assert_trees_equal(a, b):
    """Same structure, same dtypes, same values bit for bit."""
    # Two chex checks: its value checks compare bfloat16 leaves as float32, not their dtypes.
    chex.assert_trees_all_equal_dtypes(a, b)
    chex.assert_trees_all_equal(a, b)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-8):
    """Same structure and dtypes, values equal up to float32 rounding."""
    chex.assert_trees_all_equal_dtypes(a, b)
    chex.assert_trees_all_close(a, b, rtol=rtol, atol=atol)


def compiles_during(fn) -> int:
    """How many XLA compilations `fn()` triggers (jax.monitoring's public events)."""
    events = []
    listener = lambda name, *_, **__: events.append(name)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.block_until_ready(fn())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return sum("backend_compile" in name for name in events)


# -- the dtypes a program computes in ---------------------------------------------------------

def jaxpr_equations(jaxpr) -> Iterator:
    """Every equation of a (closed) jaxpr and of the jaxprs in its equations' params, each
    equation before those nested in it: the walk jamp's analyses use."""
    return equations(jaxpr)


def jaxpr_eqns(jaxpr, name: str) -> list:
    """Every equation of primitive `name` in a jaxpr and its sub-jaxprs, outermost first."""
    return [eqn for eqn in jaxpr_equations(jaxpr) if eqn.primitive.name == name]


def eqn_dtypes(eqn) -> tuple[list[str], list[str]]:
    """The dtype names of an equation's inputs and of its outputs."""
    return ([np.dtype(v.aval.dtype).name for v in eqn.invars],
            [np.dtype(v.aval.dtype).name for v in eqn.outvars])


_ELEMENT = re.compile(r"tensor<(?:[0-9?]+x)*([a-z0-9]+)>")
_HLO_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
              "i32": "int32", "i64": "int64", "i1": "bool", "ui32": "uint32"}


def hlo_op_types(text: str, op: str) -> list[tuple[str, ...]]:
    """For each `stablehlo.<op>` in `text`, the element types of its operands and result."""
    found = []
    for line in text.splitlines():
        if re.search(rf"stablehlo\.{op}\b", line) is None:
            continue
        signature = line.rsplit(" : ", 1)[-1]
        found.append(tuple(_HLO_NAMES.get(t, t) for t in _ELEMENT.findall(signature)))
    return found


def low_matmul(types: tuple[str, ...], low: str) -> bool:
    """Whether a matmul's (operands..., result) types are those of one lowered by autocast:
    operands in `low`, the result too, or float32 where it is a linear layer's accumulator,
    which its bias is added to before one rounding to `low`."""
    return all(t == low for t in types[:-1]) and types[-1] in (low, "float32")


def lowered_op_types(f, *args, op: str) -> list[tuple[str, ...]]:
    """`hlo_op_types` of `f` jitted and lowered for `args`."""
    return hlo_op_types(jax.jit(f).lower(*args).as_text(), op)
