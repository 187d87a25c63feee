"""`make demo` end to end, on a few steps of a small batch: it runs, prints the table of all five
runs and what they show, and writes its plot."""

import pathlib
import re
import subprocess
import sys

import chex
import pytest
import numpy as np

from helpers import needs_examples_extra

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

from text_data import batches, load_corpus, split  # noqa: E402

def test_corpus_is_real_text_and_batches_are_windows():
    corpus = load_corpus()
    assert corpus.dtype == np.uint8 and len(corpus) > 100_000
    assert b"statement" in corpus.tobytes()
    train, valid = split(corpus)
    window = next(batches(train, 4, 16, seed=0))
    chex.assert_shape(window, (4, 17))
    chex.assert_type(window, np.int32)
    assert len(valid) == len(corpus) - len(train)


@needs_examples_extra("tqdm", "matplotlib")
def test_demo_trains_every_level_and_reports(tmp_path):
    plot = tmp_path / "demo.png"
    # Three steps of each run is all the test needs, so its time is XLA's compiles: the
    # subprocess inherits the suite's cheap-compile XLA_FLAGS (tests/conftest.py).
    result = subprocess.run(
        [sys.executable, "demo.py", "--steps", "3", "--batch", "4", "--seq", "16",
         "--valid-batches", "1", "--out", str(plot)],
        cwd=EXAMPLES, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout

    header = next(line for line in out.splitlines() if line.startswith("run "))
    columns = re.split(r"\s{2,}", header)
    assert columns == ["run", "params", "masters", "matmuls (dot_general types)", "half FLOPs",
                       "fp8 FLOPs", "first", "train", "valid", "skipped", "step ms"]
    lines = out[out.index(header):].splitlines()[1:]
    rows = {cells[0]: dict(zip(columns, cells)) for cells in
            (re.split(r"\s{2,}", line) for line in lines[:lines.index("")])}
    o3 = "O3 bf16" if "O3 bf16" in rows else "O3"
    assert list(rows) == ["O0", "O1", "O2", o3, "autocast bf16", "fp8"]
    for name, row in rows.items():
        assert row["skipped"].endswith("/3"), name
        assert float(row["train"]) < float(row["first"]), name  # it learns
    expected = {"O0": ("float32", "-", "f32"), "O1": ("float32", "-", "f16"),
                "O2": ("float16", "float32", "f16"), "autocast bf16": ("float32", "-", "bf16"),
                "O3": ("float16", "-", "f16"), "O3 bf16": ("bfloat16", "-", "bf16")}
    fp8 = rows.pop("fp8")
    # The blocks' linear layers multiply float8 operands into float32, the rest in bfloat16.
    assert (fp8["params"], fp8["masters"]) == ("float32", "-")
    assert 0.5 < float(fp8["fp8 FLOPs"]) < 1.0
    assert float(fp8["half FLOPs"]) == pytest.approx(1.0 - float(fp8["fp8 FLOPs"]), abs=0.01)
    assert re.search(r"\d+ f8E4M3FN->f32", fp8["matmuls (dot_general types)"])
    assert re.search(r"^  \* fp8 \(tensorwise in the blocks' linear layers, \d+% of the step's "
                     r"matmul FLOPs; LM head in bfloat16\): validation loss [\d.]+, ", out, re.M)
    for name, row in rows.items():
        params, masters, matmul = expected[name]
        assert float(row["fp8 FLOPs"]) == 0.0, name
        assert (row["params"], row["masters"]) == (params, masters), name
        # (A linear layer's forward matmul accumulates in float32: "f16->f32".)
        assert re.fullmatch(rf"\d+ {matmul}(, \d+ {matmul}->f32)?",
                            row["matmuls (dot_general types)"]), name
        # amp_report's share of half-precision matmul FLOPs agrees with the matmul dtypes.
        assert float(row["half FLOPs"]) == (0.0 if matmul == "f32" else 1.0), name
    if o3 == "O3 bf16":  # the fallback is said, not silent
        assert "O3 in pure float16 did not train:" in out
        assert "cast_model_type=jnp.bfloat16" in out
    assert "after the last step the params equal the masters cast to float16" in out
    assert "What this run shows:" in out and f"{plot}" in out
    casts = re.search(r"the share of its matmul FLOPs in float16 or bfloat16 was (.*); what "
                      r"casting cost per step: (.*)\.$", out, re.M)
    assert casts is not None
    assert casts.group(1).startswith("O0 0.00, O1 1.00, O2 1.00")
    converts = dict(re.findall(r"(\S+(?: bf16)?) (\d+) converts writing", casts.group(2)))
    assert set(converts) == {*rows, "fp8"} and int(converts["O1"]) > 0

    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    closing = re.search(r"^Precision report \(jamp\.debug\) of the float16 autocast step at loss "
                        r"scale 2\^15, one batch: (.*)$", out, re.M)
    assert closing is not None
    assert re.search(r"(overflow|suggested initial loss scale 2\^-?\d+)", closing.group(1))


@needs_examples_extra("tqdm")
def test_a_pure_float16_run_that_does_not_train_is_detected_and_reported():
    import demo

    def result(name, losses, skipped=(), params="float32", diverged_at=None):
        return demo.Result(name, list(losses), [1.0] * len(losses), list(skipped), step_ms=1.0,
                           valid=2.0, params=params, masters="-", state="float32",
                           matmuls="51 f32", half_flops=0.0, casts=(0, 0),
                           diverged_at=diverged_at)

    falling = [6.0 - 0.1 * i for i in range(40)]
    o0, o3_bf16 = result("O0", falling), result("O3 bf16", falling, params="bfloat16")
    nan = result("O3", [6.0, 4.7, float("nan")], skipped=[2], params="float16", diverged_at=2)
    overflowing = result("O3", [6.0, 4.7] + [9.0] * 10, skipped=range(2, 12), params="float16",
                         diverged_at=2)
    flat = result("O3", [6.0] * 40, params="float16")
    assert demo.learned(o0, o0) and demo.learned(o3_bf16, o0)
    for failed, why in [(nan, "its loss was nan at step 2 (before it: 6.000, 4.700)"),
                        (overflowing, "from step 2 on its grads held inf or nan"),
                        (flat, "its loss went from 6.000 to 6.000 in 40 steps")]:
        assert not demo.learned(failed, o0)
        said = "\n".join(demo.conclusions([o0, o3_bf16], failed, tolerance=0.05))
        assert f"O3 in pure float16 did not train: {why}" in said
        assert "So O3 ran again with cast_model_type=jnp.bfloat16 ('O3 bf16')" in said
    said = "\n".join(demo.conclusions([o0, result("O3", falling, params="float16")], None, 0.05))
    assert "O3 trained in pure float16" in said and "no bfloat16 fallback was needed" in said
