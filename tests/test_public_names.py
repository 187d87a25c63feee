"""Every public name of jamp resolves to one thing: a submodule is reached as a module, never
hidden by a function of its name, and every public module states its names in `__all__`."""

import importlib
import inspect
import pkgutil
import types

import pytest

import jamp

MODULES = sorted(info.name for info in pkgutil.walk_packages(jamp.__path__, prefix="jamp."))
PUBLIC = [name for name in ["jamp"] + MODULES
          if not any(part.startswith("_") for part in name.split("."))]


@pytest.mark.parametrize("name", MODULES)
def test_each_submodule_is_a_plain_module_reached_by_its_name(name):
    module = importlib.import_module(name)
    assert type(module) is types.ModuleType, f"{name} is a {type(module).__name__}"
    parent_name, _, leaf = name.rpartition(".")
    parent = importlib.import_module(parent_name)
    assert getattr(parent, leaf) is module, (
        f"{parent_name}.{leaf} is {getattr(parent, leaf)!r}, not the module {name}")


@pytest.mark.parametrize("name, kind", [
    ("jamp.master_weights", "function"),
    ("jamp.frontend.master_weights", "function"),
    ("jamp.frontend.master_params", "function"),
    ("jamp.initialize", "function"),
    ("jamp.frontend.initialize", "function"),
    ("jamp.profile.amp_report", "function"),
    ("jamp.profile.profile", "class"),
    ("jamp.autograd.gradcheck", "function"),
    ("jamp.autograd.gradgradcheck", "function"),
    ("jamp.autograd.profiler", "module"),
    ("jamp.autocast", "function"),
])
def test_public_names_are_what_they_name(name, kind):
    package, _, leaf = name.rpartition(".")
    value = getattr(importlib.import_module(package), leaf)
    check = {"function": inspect.isfunction, "class": inspect.isclass,
             "module": inspect.ismodule}[kind]
    assert check(value), f"{name} is {value!r}, not a {kind}"


def test_gradcheck_is_called_as_torch_users_call_it():
    import jax.numpy as jnp

    with pytest.warns(UserWarning, match="not double precision"):
        assert jamp.autograd.gradcheck(jnp.sin, (jnp.array([0.5, 1.0], jnp.float32),),
                                       eps=1e-2, atol=1e-2, rtol=1e-2)
    from jamp.autograd import GradcheckError, gradcheck, gradgradcheck  # noqa: F401


@pytest.mark.parametrize("name", PUBLIC)
def test_each_public_module_lists_exactly_its_public_names(name):
    module = importlib.import_module(name)
    assert hasattr(module, "__all__"), f"{name} has no __all__"
    listed = list(module.__all__)
    assert len(set(listed)) == len(listed), f"{name}.__all__ repeats a name"
    missing = [n for n in listed if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ lists names it does not have: {missing}"
    private = [n for n in listed if n.startswith("_")]
    assert not private, f"{name}.__all__ lists private names: {private}"
    defined_here = [n for n, v in vars(module).items()
                    if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
                    and v.__module__ == name]
    unlisted = sorted(set(defined_here) - set(listed))
    assert not unlisted, (f"{name} defines public {unlisted} but leaves them out of __all__: "
                          f"list them, or name them with a leading underscore")
