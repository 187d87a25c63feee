"""Bytes that are not a whole checkpoint: `checkpoint_from_bytes` refuses them with a `ValueError`
that says what it was reading, and keeps the decoder's error as the cause."""

import jax.numpy as jnp
import pytest

import jamp

TARGET = {"params": {"w": jnp.ones(3), "b": jnp.zeros(2)}}
BLOB = jamp.checkpoint_to_bytes(TARGET)


@pytest.mark.parametrize("blob", [BLOB[: len(BLOB) // 2], BLOB[:-1], b"", b"\xc1 not msgpack",
                                  b"\x93\x01"],
                         ids=["half", "last-byte-cut", "empty", "reserved-byte", "short-array"])
def test_corrupt_bytes_name_the_checkpoint_and_its_target(blob):
    with pytest.raises(ValueError, match=r"jamp checkpoint .*dict of 2 arrays") as raised:
        jamp.checkpoint_from_bytes(TARGET, blob)
    assert raised.value.__cause__ is not None  # msgpack's own words, for whoever digs deeper


def test_whole_bytes_still_restore():
    restored = jamp.checkpoint_from_bytes(TARGET, BLOB)
    assert restored["params"]["w"].tolist() == [1.0, 1.0, 1.0]
