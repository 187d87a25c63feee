"""A real text corpus that ships with Python: the Language Reference topics of `pydoc`.

About 460 KB of English prose and code from the Python documentation, read as bytes, so the
model is a byte-level language model (vocabulary 256). No download is needed.
"""

from __future__ import annotations

import numpy as np


def load_corpus() -> np.ndarray:
    """The corpus as a uint8 array of bytes."""
    try:
        from pydoc_data.topics import topics
        text = "\n\n".join(topics[key] for key in sorted(topics))
    except ImportError:  # a Python built without pydoc_data: fall back to the stdlib's own source
        import inspect
        import json
        import textwrap
        text = "\n".join(inspect.getsource(m) for m in (json, textwrap, inspect))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def split(corpus: np.ndarray, valid_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation parts: the last `valid_fraction` of the text is held out."""
    cut = int(len(corpus) * (1 - valid_fraction))
    return corpus[:cut], corpus[cut:]


def batches(data: np.ndarray, batch_size: int, seq_len: int, seed: int):
    """An endless stream of random windows of `seq_len + 1` bytes, as int32 [batch, seq_len+1]."""
    rng = np.random.default_rng(seed)
    while True:
        yield _windows(data, batch_size, seq_len, rng)


def batch_at(data: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """The batch of step `step`, drawn from `seed` and `step` alone: a run that resumes at a
    step reads the batches that an uninterrupted run reads there."""
    return _windows(data, batch_size, seq_len, np.random.default_rng([seed, step]))


def _windows(data: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator):
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
    return np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)
