"""Every `>>>` example in jamp's docstrings runs as written and prints what it shows.

Each example starts from an empty namespace, not from its module's globals: it imports and
defines what it uses, so a reader can paste it into a fresh interpreter (optax's rule).
"""

import doctest
import importlib
import pkgutil

import pytest

import jamp

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _examples():
    finder = doctest.DocTestFinder()
    found = []
    for info in pkgutil.walk_packages(jamp.__path__, prefix="jamp."):
        module = importlib.import_module(info.name)
        found += [t for t in finder.find(module, module.__name__, globs={}) if t.examples]
    return sorted(found, key=lambda t: t.name)


EXAMPLES = _examples()


def test_examples_are_found():
    names = {t.name for t in EXAMPLES}
    assert {"jamp.transforms.autocast_api.autocast", "jamp.policy.policy.Policy",
            "jamp.scaler.grad_scaler.GradScaler"} <= names


@pytest.mark.parametrize("test", EXAMPLES, ids=[t.name for t in EXAMPLES])
def test_docstring_example(test):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report = []
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
