"""The package's metadata holds what its code needs, and nothing it does not; it carries the
PEP 561 marker; the jax it runs on is inside the range it states, and the README states it."""

import importlib.metadata
import importlib.resources
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).parents[1]
# Distributions imported under another name (jaxlib is what jax itself loads).
IMPORT_NAMES = {"jaxlib": "jax"}


def test_every_runtime_dependency_is_imported_by_jamp():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in deps]
    source = "\n".join(p.read_text() for p in (ROOT / "jamp").rglob("*.py"))
    imported = set(re.findall(r"^\s*(?:from|import)\s+([A-Za-z0-9_]+)", source, re.M))
    unused = [n for n in names if IMPORT_NAMES.get(n, n) not in imported]
    assert not unused, f"runtime dependencies nothing in jamp imports: {unused}"


def test_the_installed_package_carries_the_pep_561_marker():
    assert (importlib.resources.files("jamp") / "py.typed").is_file()


def _jax_requirement() -> str:
    pyproject = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"jax(>=[^"]+)"', pyproject).group(1)


def test_the_installed_jax_is_inside_the_supported_range():
    spec = dict(re.findall(r"([<>]=?)([\d.]+)", _jax_requirement()))
    installed = tuple(int(p) for p in importlib.metadata.version("jax").split(".")[:2])
    assert installed >= tuple(int(p) for p in spec[">="].split("."))
    assert installed < tuple(int(p) for p in spec["<"].split("."))


def test_the_readme_version_table_states_the_same_jax_range_and_why():
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| jax / jaxlib"))
    assert f"`{_jax_requirement()}`" in row
    assert "_jax_internals.py" in row  # the reason for the cap is stated beside it


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
