"""Test-wide set-up: eight CPU devices, so sharding tests run on any machine; cheaper XLA
compiles; the `variant` fixture that runs a test eagerly and under jit; the `torch` fixture.

XLA reads its flags once, when the backend starts, so they are set before anything imports jax.
The suite is mostly compiles of small programs: LLVM's lowest optimization level (and, where the
running jaxlib still has them, XLA's older CPU emitters) compile about three times faster and
compute the same values (they change how fast the machine code runs, not what the HLO computes;
the tests read dtypes from the lowered programs, which these flags do not touch). A flag already
in XLA_FLAGS is kept. XLA aborts the process on a flag it does not know, and jaxlib drops flags
between versions, so each optional flag is first tried in a child process (once: pytest-xdist's
workers inherit the result through the environment).
A test parametrized by both the autocast table (`device_type`: "cpu", "cuda") and the `variant`
(eager, jit) runs two of its four pairs: each table once, each variant once, the pairing chosen
per test (and per its other parameters) by a hash of its name, so that every pairing runs
somewhere in the suite. The table decides the dtypes and the variant the code path; their
product costs a full compile set per pair. `pytest --all-pairs` runs all four.
Shared constants and helpers are in `helpers.py`, imported as `helpers`.
"""

import os
import subprocess
import sys
import zlib

_FLAGS = {
    "--xla_force_host_platform_device_count": "8",
    "--xla_backend_optimization_level": "0",
}
# Flags some jaxlib versions no longer know (jaxlib 0.12 removed the older CPU emitters).
_OPTIONAL_FLAGS = {
    "--xla_cpu_use_fusion_emitters": "false",
}


def _xla_accepts(flag: str) -> bool:
    probe = "import jax; jax.devices()"
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          timeout=120).returncode == 0


def _set_xla_flags() -> None:
    given = os.environ.get("XLA_FLAGS", "")
    wanted = dict(_FLAGS)
    if "JAMP_TEST_XLA_FLAGS_SET" not in os.environ:
        wanted.update({flag: value for flag, value in _OPTIONAL_FLAGS.items()
                       if flag in given or _xla_accepts(f"{flag}={value}")})
        os.environ["JAMP_TEST_XLA_FLAGS_SET"] = "1"
    missing = [f"{flag}={value}" for flag, value in wanted.items() if flag not in given]
    os.environ["XLA_FLAGS"] = " ".join([given, *missing]).strip()


_set_xla_flags()

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--all-pairs", action="store_true",
                     help="run every (device_type, variant) pair of the tests that take both")


def _runs_pair(item) -> bool:
    """Whether `item`, a test taking both `device_type` and `variant`, is one of the two
    pairs its test runs (see the module docstring)."""
    params = item.callspec.params
    table, variant = params["device_type"], params["variant"]
    # Keyed by the test's id without these two (the same in every pytest-xdist worker).
    others = [part for part in item.callspec.id.split("-") if part not in (table, variant)]
    swapped = zlib.crc32(f"{item.originalname}{others}".encode()) % 2
    return (variant == "jit") == ((table == "cuda") != bool(swapped))


def pytest_collection_modifyitems(config, items):
    if config.getoption("--all-pairs"):
        return
    kept, deselected = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        pair = "device_type" in params and "variant" in params
        (kept if not pair or _runs_pair(item) else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.fixture(params=["eager", "jit"])
def variant(request):
    """Runs a test twice: `variant(f)` is `f` itself in the "eager" run and `jax.jit(f)` in the
    "jit" run (chex.variants' without_jit / with_jit). Usable as a decorator.

    As with chex, a test that asks for the fixture and never calls it fails.
    """
    # chex's own `chex.variants` does not fit here: it unrolls a test into one test per variant
    # through absl's `parameterized.TestCase` generators, which pytest functions (and their
    # fixtures and parametrize marks) are not; its variant functions are not public apart
    # from it. This fixture is its pytest form, with the same two variants and the same check.
    calls = []

    def wrap(f):
        calls.append(f)
        return jax.jit(f) if request.param == "jit" else f

    yield wrap
    if not calls:
        pytest.fail(f"{request.node.name} takes `variant` but never calls it")


@pytest.fixture(scope="session")
def torch():
    """torch (its CPU build), the test-only oracle. A test that takes it is skipped where torch
    is not installed, and only that test: a file's other tests still run."""
    return pytest.importorskip("torch")
