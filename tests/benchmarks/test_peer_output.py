"""autocast_overhead's report holds its own figures only: what a peer prints is dropped."""

import pathlib
import sys
import types

import jax
import jax.numpy as jnp
import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import autocast_overhead  # noqa: E402


def _chatty_autocast(f, **options):
    """A peer like grampax 0.1.0: it prints an array for every operation it traces."""
    def transformed(*args):
        for a in args:
            print(a)
        print("traced", options)
        return f(*args)
    return transformed


@pytest.fixture
def chatty_peers(monkeypatch):
    monkeypatch.setitem(sys.modules, "grampax", types.SimpleNamespace(autocast=_chatty_autocast))
    monkeypatch.setitem(sys.modules, "jaxamp", types.SimpleNamespace(amp=_chatty_autocast))


def test_peers_print_nothing_into_the_report(chatty_peers, capsys):
    peers = autocast_overhead.peer_autocasts()
    assert sorted(peers) == ["grampax.autocast", "jaxamp.amp"]
    x = jnp.arange(4.0)
    for name, wrap in peers.items():
        loss = wrap(lambda x: jnp.sum(x ** 2))
        value, grad = jax.jit(jax.value_and_grad(loss))(x)  # traced: the peer prints
        assert float(value) == 14.0, name
        assert grad.tolist() == [0.0, 2.0, 4.0, 6.0]
        jax.jit(jax.value_and_grad(loss)).lower(x).compile()  # compile_times' path
    captured = capsys.readouterr()
    assert captured.out == ""


def test_silenced_leaves_printing_as_it_was_afterwards(capsys):
    quiet = autocast_overhead.silenced(lambda: print("from the peer") or 3)
    assert quiet() == 3
    print("from the report")
    assert capsys.readouterr().out == "from the report\n"
