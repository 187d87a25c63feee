"""The package's metadata holds what its code needs, and nothing it does not; it carries the
PEP 561 marker; the jax it runs on is inside the range it states."""

import importlib.metadata
import importlib.resources
import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).parents[1]
# Distributions imported under another name (jaxlib is what jax itself loads).
IMPORT_NAMES = {"jaxlib": "jax"}


def test_every_runtime_dependency_is_imported_by_jamp():
    # In a fresh interpreter, so that what the tests import does not count.
    deps = _pyproject()["project"]["dependencies"]
    names = [re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in deps]
    script = ("import importlib, pkgutil, sys, jamp\n"
              "for info in pkgutil.walk_packages(jamp.__path__, prefix='jamp.'):\n"
              "    importlib.import_module(info.name)\n"
              "print(' '.join(sorted({name.split('.')[0] for name in sys.modules})))")
    loaded = subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    unused = [n for n in names if IMPORT_NAMES.get(n, n.replace("-", "_")) not in loaded]
    assert not unused, f"runtime dependencies nothing in jamp imports: {unused}"


def test_the_installed_package_carries_the_pep_561_marker():
    assert (importlib.resources.files("jamp") / "py.typed").is_file()


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _jax_requirement() -> str:
    return next(d for d in _pyproject()["project"]["dependencies"]
                if re.match(r"jax\b(?!lib)", d))


def test_the_installed_jax_is_inside_the_supported_range():
    spec = dict(re.findall(r"([<>]=?)([\d.]+)", _jax_requirement()))
    installed = tuple(int(p) for p in importlib.metadata.version("jax").split(".")[:2])
    assert installed >= tuple(int(p) for p in spec[">="].split("."))
    assert installed < tuple(int(p) for p in spec["<"].split("."))


PACKAGES = ["jamp", "jamp.autograd", "jamp.debug", "jamp.frontend", "jamp.policy", "jamp.profile",
            "jamp.scaler", "jamp.transforms"]


def test_each_package_all_lists_exactly_its_public_names():
    # `from jamp import *` and the API docs read __all__: a name re-exported but left out of
    # it (or listed but gone) is an API the package does not state.
    import importlib
    import types

    for name in PACKAGES:
        package = importlib.import_module(name)
        public = {n for n, v in vars(package).items()
                  if not n.startswith("_") and n not in ("annotations",)
                  and not (isinstance(v, types.ModuleType) and not v.__name__.startswith(name))}
        public -= {n for n, v in vars(package).items()
                   if isinstance(v, types.ModuleType) and n not in package.__all__
                   and v.__name__.startswith(name + ".")}
        assert sorted(public) == sorted(package.__all__), name
