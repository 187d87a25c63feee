"""jmp's own test suite, run against jamp by changing its import.

The tests ship in the jmp wheel (`jmp/_src/*_test.py`). Each file imports the module it tests as
`from jmp._src import <module> as jmp`; here that module is jamp's (`jamp.scaler` for the loss
scales, `jamp.policy` for the policies) while the file runs, so every test exercises jamp.
"""

import importlib.util
import pathlib
import sys
import unittest

import pytest

import jamp.policy
import jamp.scaler

jmp_src = pytest.importorskip("jmp._src")
pytest.importorskip("absl.testing.parameterized")

SUITES = {"loss_scale": jamp.scaler, "policy": jamp.policy}


def _load_against_jamp(module: str, ours):
    """jmp's `<module>_test.py`, imported with `jmp._src.<module>` standing for `ours`."""
    path = pathlib.Path(jmp_src.__file__).parent / f"{module}_test.py"
    spec = importlib.util.spec_from_file_location(f"jmp_{module}_test_against_jamp", path)
    test_module = importlib.util.module_from_spec(spec)
    name = f"jmp._src.{module}"
    saved = sys.modules.get(name), getattr(jmp_src, module, None)
    sys.modules[name] = ours
    setattr(jmp_src, module, ours)
    try:
        spec.loader.exec_module(test_module)
    finally:
        sys.modules[name] = saved[0]
        setattr(jmp_src, module, saved[1])
    return test_module


@pytest.mark.parametrize("module", sorted(SUITES))
def test_jmp_suite_passes_against_jamp(module):
    test_module = _load_against_jamp(module, SUITES[module])
    suite = unittest.defaultTestLoader.loadTestsFromModule(test_module)
    assert suite.countTestCases() > 10  # the file really was collected
    result = unittest.TestResult()
    suite.run(result)
    problems = [f"{test}: {trace.splitlines()[-1]}" for test, trace in
                result.failures + result.errors]
    assert not problems, "\n".join(problems)
