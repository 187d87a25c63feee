"""The examples beside `make demo`, each run on a few steps: they train and print what is true.

Each example's `main` is called in this process (no subprocess: one jax start-up for all), with
the tests' eight CPU devices (tests/conftest.py), which `data_parallel.py` needs.
"""

import json
import math
import pathlib
import sys

import jax
import numpy as np

from helpers import needs_examples_extra

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import cnn_digits  # noqa: E402
import data_parallel  # noqa: E402
import gan  # noqa: E402
import profile_step  # noqa: E402


@needs_examples_extra("sklearn")  # the 8x8 digits
def test_cnn_digits_trains_at_every_opt_level_with_its_dtypes(capsys):
    results = {r["level"]: r for r in cnn_digits.main(["--steps", "25"])}
    out = capsys.readouterr().out
    assert list(results) == ["O0", "O1", "O2", "O3"]
    for level, r in results.items():
        assert np.all(np.isfinite(r["losses"])), level
        assert r["losses"][-5:].mean() < 0.7 * r["losses"][0], level  # it learns
        assert r["accuracy"] > 0.5, level  # chance is 0.1
    dtypes = {level: r["dtypes"] for level, r in results.items()}
    assert dtypes["O0"] == {"kernels": "float32", "BatchNorm params": "float32",
                            "batch stats": "float32", "masters": "float32",
                            "convs, matmuls": "f32 x8"}
    assert dtypes["O1"]["kernels"] == "float32" and dtypes["O1"]["convs, matmuls"] == "f16 x8"
    assert dtypes["O2"] == {"kernels": "float16", "BatchNorm params": "float32",
                            "batch stats": "float32", "masters": "float32",
                            "convs, matmuls": "f16 x8"}
    assert dtypes["O3"] == {"kernels": "float16", "BatchNorm params": "float16",
                            "batch stats": "float16", "masters": "float16",
                            "convs, matmuls": "f16 x8"}
    assert "Every level learned" in out and "At O2 the convs and matmuls ran in f16 x8" in out


@needs_examples_extra("sklearn")  # cnn_digits' data and model
def test_data_parallel_steps_equal_the_single_device_steps(capsys):
    result = data_parallel.main(["--steps", "4"])
    out = capsys.readouterr().out
    assert result["equal"], result["stepwise"]
    worst = result["stepwise"]["worst"]
    assert set(worst) == set(data_parallel.TOLERANCES)
    assert worst["loss scale, skipped steps"] == (0.0, 0.0)
    assert 0 < worst["grads / leaf's largest"][0]  # it compared something
    # The grads of the float16 weights are all-reduced in float16, the rest in float32.
    assert "f16" in result["all_reduces"] and "f32" in result["all_reduces"]
    single, parallel = result["single"], result["parallel"]
    kernel = parallel["state"][0]["Conv_0"]["kernel"]
    assert kernel.sharding.is_fully_replicated and len(kernel.devices()) == len(jax.devices())
    np.testing.assert_allclose(parallel["losses"], single["losses"], rtol=1e-3)
    assert parallel["losses"][-1] < parallel["losses"][0]
    assert "In every one of the 4 steps the 8-device loss, grads and batch statistics" in out


def test_data_parallel_tolerances_catch_a_real_difference():
    ref = {"w": np.array([1.0, -0.5, 0.0])}
    grads = data_parallel.TOLERANCES["grads / leaf's largest"]
    # A grad one float16 ulp off passes; one 2% of the leaf's largest off does not.
    assert data_parallel._worst(ref, {"w": ref["w"] + [2.0**-10, 0, 0]}, **grads,
                                per_leaf=True)[1] <= 1
    assert data_parallel._worst(ref, {"w": ref["w"] + [0, 0, 0.02]}, **grads,
                                per_leaf=True)[1] > 1
    exact = data_parallel.TOLERANCES["loss scale, skipped steps"]
    assert data_parallel._worst(1.0, 1.0, **exact) == (0.0, 0.0)
    assert data_parallel._worst(1.0, 2.0, **exact)[1] > 1


def test_gan_keeps_three_loss_scales_and_its_samples_approach_the_ring(capsys):
    result = gan.main(["--steps", "150", "--batch", "64", "--log-every", "50"])
    out = capsys.readouterr().out
    assert [row["step"] for row in result["log"]] == [50, 100, 150]
    for row in result["log"]:
        assert all(math.isfinite(loss) for loss in row["losses"])
        assert len(row["scales"]) == 3 and all(s > 0 for s in row["scales"])
    for sd in result["state_dicts"].values():
        assert sorted(sd) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    # Each optimizer's own losses counted its steps; the other optimizer's losses never moved.
    d, g = result["state_dicts"]["discriminator"], result["state_dicts"]["generator"]
    assert d["loss_scaler2"] == {"loss_scale": 65536.0, "unskipped": 0}
    assert g["loss_scaler0"] == g["loss_scaler1"] == {"loss_scale": 65536.0, "unskipped": 0}
    assert g["loss_scaler2"]["unskipped"] > 0 and d["loss_scaler0"]["unskipped"] > 0
    assert result["dtypes"]["generator params"] == "float16"
    assert result["dtypes"]["masters"] == "float32"
    first, last = result["initial"], result["log"][-1]["quality"]
    assert last["energy"] < 0.5 * first["energy"]  # the samples approach the real ones
    assert "moved toward the real distribution" in out


def test_profile_step_reports_precision_and_times_of_the_three_steps(capsys, tmp_path):
    out = tmp_path / "profile.json"
    result = profile_step.main(["--steps", "2", "--batch", "2", "--seq", "16", "--width", "32",
                                "--depth", "1", "--rows", "5", "--out", str(out)])
    printed = capsys.readouterr().out
    r = result["results"]
    assert list(r) == ["float32", "autocast float16", "hand-written float16"]
    assert r["float32"]["half_flops_fraction"] == 0.0
    assert r["autocast float16"]["half_flops_fraction"] == 1.0
    assert r["hand-written float16"]["half_flops_fraction"] == 1.0
    assert r["autocast float16"]["converts"] > r["float32"]["converts"]
    for name, numbers in r.items():
        assert numbers["step_time_us"] > 0 and math.isfinite(numbers["ratio_to_float32"]), name
    prof, _ = result["profiles"]["autocast float16"]
    rows = {row.key: row for row in prof.key_averages()}
    assert rows["autocast float16"].count == rows["jit_autocast_step"].count == 2
    assert "Self CPU time total" in printed and "half_flops_fraction 1.000" in printed
    saved = json.loads(out.read_text())
    assert saved["results"]["autocast float16"]["half_flops_fraction"] == 1.0
