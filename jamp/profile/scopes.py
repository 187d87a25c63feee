"""Which `jax.named_scope` names are modules: one rule for the profiler and the AMP report.

Flax linen names each module's call with a scope (`Model`, `Dense_0`), and so may users. Two
kinds of scope name are not modules: autocast's region markers, and the scopes `jnp.einsum`
opens named by its subscripts (`...hqk,...khd->...qhd`), which are one op of the module around
them. A name repeated right after itself is one module calling its own method again (linen's
`SelfAttention` calls `MultiHeadDotProductAttention.__call__`).
"""

from __future__ import annotations

from typing import Iterable

from jamp.transforms.autocast_rules import MARKER_PREFIX


def is_module_scope(name: str) -> bool:
    return bool(name) and not name.startswith(MARKER_PREFIX) and "->" not in name


def module_path(outer: Iterable[str], names: Iterable[str]) -> tuple[str, ...]:
    """`outer` extended by the module scopes among `names` (outermost first)."""
    path = list(outer)
    for name in names:
        if is_module_scope(name) and (not path or path[-1] != name):
            path.append(name)
    return tuple(path)
