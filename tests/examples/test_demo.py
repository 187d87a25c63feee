"""`make demo` end to end, on a few steps of a small batch: it runs and prints what is true."""

import pathlib
import re
import subprocess
import sys

import numpy as np

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

from text_data import batches, load_corpus, split  # noqa: E402


def test_corpus_is_real_text_and_batches_are_windows():
    corpus = load_corpus()
    assert corpus.dtype == np.uint8 and len(corpus) > 100_000
    assert b"statement" in corpus.tobytes()
    train, valid = split(corpus)
    window = next(batches(train, 4, 16, seed=0))
    assert window.shape == (4, 17) and window.dtype == np.int32
    assert len(valid) == len(corpus) - len(train)


def test_demo_trains_and_reports():
    result = subprocess.run(
        [sys.executable, "demo.py", "--steps", "12", "--batch", "4", "--seq", "16",
         "--growth-interval", "5"],
        cwd=EXAMPLES, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    dtypes = dict(re.findall(r"^  (\S.*?)\s{2,}(\{.*\})$", out, re.M))
    assert "'dot_general': {'f32'" in dtypes["float32"]
    assert "'dot_general': {'bf16'" in dtypes["autocast bfloat16 + DynamicLossScale"]
    assert "'dot_general': {'f16'" in dtypes["autocast float16 + GradScaler"]
    assert "'exponential': {'f32'" in dtypes["autocast float16 + GradScaler"]
    rows = re.findall(r"^(float32|autocast \S+ \+ \S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+"
                      r"(\d+)/(\d+)\s+([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["float32", "autocast bfloat16 + DynamicLossScale",
                                    "autocast float16 + GradScaler"]
    for name, first, train, valid, skipped, total, step_ms in rows:
        assert float(train) < float(first), name  # it learns
        assert int(total) == 12
    assert "step    4: grew to 65536" in out  # bfloat16 run: 2**15 doubled after 5 finite steps
