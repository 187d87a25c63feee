"""Anomaly mode nested torch's way: `set_detect_anomaly` inside a `with detect_anomaly():` block
sets the mode in effect inside it (a NaN passes under `set_detect_anomaly(False)`), the block's
mode returns when the inner one ends, and the mode before the block when the block ends."""

import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp.autograd import anomaly_mode
from jamp.autograd.anomaly_mode import (detect_anomaly, is_anomaly_check_nan_enabled,
                                        is_anomaly_enabled, set_detect_anomaly)

pytestmark = pytest.mark.filterwarnings("ignore:jamp anomaly detection is on")

NEGATIVE = jnp.array([-1.0, 4.0])
root_grad = jax.jit(jax.grad(lambda x: jnp.sqrt(x).sum()))  # a NaN gradient at -1


def jax_checks():
    return jax.config.jax_debug_nans, jax.config.jax_debug_infs


def mode(api):
    """The mode in effect: whether it is on and, while on, whether it checks for NaN (torch
    reports its NaN flag also while the mode is off; jamp says False then)."""
    on = api.is_anomaly_enabled()
    return on, on and api.is_anomaly_check_nan_enabled()


def nestings(api) -> list:
    """The mode at each step of nestings both ways, for `api` (jamp's anomaly_mode or torch)."""
    seen = []
    with api.detect_anomaly():
        seen.append(mode(api))
        with api.set_detect_anomaly(False):
            seen.append(mode(api))
            with api.set_detect_anomaly(True, check_nan=False):
                seen.append(mode(api))
            seen.append(mode(api))
            with api.detect_anomaly(check_nan=False):
                seen.append(mode(api))
            seen.append(mode(api))
        seen.append(mode(api))
        api.set_detect_anomaly(False)  # a statement: until the block ends
        seen.append(mode(api))
    seen.append(mode(api))
    with api.set_detect_anomaly(False):
        with api.detect_anomaly():
            api.set_detect_anomaly(True, check_nan=False)
            seen.append(mode(api))
        seen.append(mode(api))
        api.set_detect_anomaly(True)
        seen.append(mode(api))
    seen.append(mode(api))
    return seen


EXPECTED = [(True, True), (False, False), (True, False), (False, False), (True, False),
            (False, False), (True, True), (False, False), (False, False), (True, False),
            (False, False), (True, True), (False, False)]


def test_set_detect_anomaly_inside_a_block_sets_the_mode_there():
    assert nestings(anomaly_mode) == EXPECTED
    assert jax_checks() == (False, False)


def test_the_nestings_match_torch():
    torch = pytest.importorskip("torch")
    api = types.SimpleNamespace(
        detect_anomaly=torch.autograd.detect_anomaly,
        set_detect_anomaly=torch.autograd.set_detect_anomaly,
        is_anomaly_enabled=torch.is_anomaly_enabled,
        is_anomaly_check_nan_enabled=torch.is_anomaly_check_nan_enabled)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's warning that the mode slows things down
        assert nestings(api) == nestings(anomaly_mode)


def test_a_nan_passes_where_the_inner_mode_is_off():
    with detect_anomaly():
        with set_detect_anomaly(False):
            assert jax_checks() == (False, False)
            assert np.isnan(root_grad(NEGATIVE)[0])
            with set_detect_anomaly(True):
                with pytest.raises(FloatingPointError, match="nan"):
                    root_grad(NEGATIVE)
        with set_detect_anomaly(True, check_nan=False):
            assert np.isnan(root_grad(NEGATIVE)[0])
        with set_detect_anomaly(True, check_nan=False, check_inf=True):
            assert jax_checks() == (False, True)
        assert jax_checks() == (True, False)
        with pytest.raises(FloatingPointError, match="nan"):
            root_grad(NEGATIVE)
    assert np.isnan(root_grad(NEGATIVE)[0])


def test_a_statement_inside_a_block_lasts_until_the_block_ends():
    with detect_anomaly():
        set_detect_anomaly(False)
        assert np.isnan(root_grad(NEGATIVE)[0])
    with set_detect_anomaly(False):
        with detect_anomaly(check_nan=False):
            set_detect_anomaly(True)
            with pytest.raises(FloatingPointError, match="nan"):
                root_grad(NEGATIVE)
        assert not is_anomaly_enabled() and not is_anomaly_check_nan_enabled()
        assert np.isnan(root_grad(NEGATIVE)[0])
    assert jax_checks() == (False, False)
