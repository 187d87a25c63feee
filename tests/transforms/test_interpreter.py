"""The autocast interpreter run on a traced jaxpr directly: it reads the dtypes of tracers,
arrays and literals alike, and refuses a wrong number of arguments."""

import jax
import numpy as np
import pytest

from jamp.policy import autocast_table
from jamp.transforms import autocast_rules as rules
from jamp.transforms import interpreter

from helpers import BF16, W, X


def matmul(x, w):
    return x @ w


def _region():
    return rules.Region(enabled=True, dtype=BF16, table=autocast_table("cpu"))


def test_the_interpreter_reads_dtypes_of_tracers_arrays_and_literals(variant):
    # A weak Python scalar becomes a literal of the jaxpr; x and w are arrays or tracers.
    closed = jax.make_jaxpr(lambda x, w: (x @ w) * 2.0 + 1)(X, W)

    def run(x, w):
        return interpreter.eval_jaxpr(closed, [x, w], _region(), interpreter.Context())

    (out,) = variant(run)(X, W)
    assert out.dtype == BF16
    np.testing.assert_allclose(np.asarray(out, np.float32), (X @ W) * 2.0 + 1, rtol=2e-2,
                               atol=2e-2)


@pytest.mark.parametrize("args", [[X], [X, W, W]], ids=["too few", "too many"])
def test_the_interpreter_refuses_a_wrong_number_of_arguments(args):
    # An extra argument is not dropped without a word, nor a missing one found only when it
    # is read.
    closed = jax.make_jaxpr(matmul)(X, W)
    with pytest.raises(ValueError, match="zip"):
        interpreter.eval_jaxpr(closed, args, _region(), interpreter.Context())

