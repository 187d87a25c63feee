"""Test-wide set-up: eight CPU devices, so sharding tests run on any machine; the `variant`
fixture that runs a test eagerly and under jit.

XLA reads the device flag once, when the backend starts, so it is set before anything imports
jax. Shared constants and helpers are in `helpers.py`, imported as `helpers`.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

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
