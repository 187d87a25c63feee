"""The package's metadata holds what its code needs, and nothing it does not."""

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
