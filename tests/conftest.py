"""Test-wide set-up: eight CPU devices, so sharding tests run on any machine; cheaper XLA
compiles; the `variant` fixture that runs a test eagerly and under jit.

XLA reads its flags once, when the backend starts, so they are set before anything imports jax.
The suite is mostly compiles of small programs: LLVM's lowest optimization level and XLA's
older CPU emitters compile about three times faster and compute the same values (they change
how fast the machine code runs, not what the HLO computes; the tests read dtypes from the
lowered programs, which these flags do not touch). A flag already in XLA_FLAGS is kept.
Shared constants and helpers are in `helpers.py`, imported as `helpers`.
"""

import os

_FLAGS = {
    "--xla_force_host_platform_device_count": "8",
    "--xla_backend_optimization_level": "0",
    "--xla_cpu_use_fusion_emitters": "false",
}
_given = os.environ.get("XLA_FLAGS", "")
_missing = [f"{flag}={value}" for flag, value in _FLAGS.items() if flag not in _given]
os.environ["XLA_FLAGS"] = " ".join([_given, *_missing]).strip()

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(params=["eager", "jit"])
def variant(request):
    """Runs a test twice: `variant(f)` is `f` itself in the "eager" run and `jax.jit(f)` in the
    "jit" run (chex.variants' without_jit / with_jit). Usable as a decorator.

    As with chex, a test that asks for the fixture and never calls it fails.
    """
    calls = []

    def wrap(f):
        calls.append(f)
        return jax.jit(f) if request.param == "jit" else f

    yield wrap
    if not calls:
        pytest.fail(f"{request.node.name} takes `variant` but never calls it")
