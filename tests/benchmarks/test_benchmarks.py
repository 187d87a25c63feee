"""The benchmarks' statistics say what they claim, and the overhead benchmarks run end to end.

Each benchmark's `main` runs in this process, as `python <script> <options>` would run it (its
command line in `sys.argv`), on the tests' devices: no second jax start-up per script.
"""

import importlib
import pathlib
import re
import sys
import warnings

import numpy as np

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from common import median_interval, paired_ratios, verdict  # noqa: E402


def test_median_interval_is_the_order_statistics_around_the_middle():
    xs = list(range(1, 501))[::-1]  # any order
    # ranks 250 -/+ 1.96 * sqrt(500) / 2 = 250 -/+ 21.9 -> 228 and 272
    assert median_interval(xs) == (228, 272)
    assert median_interval([1.0] * 7) is None  # too few samples for an interval


def test_median_interval_covers_the_true_median_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    true_median = 1.0  # the median of a lognormal with mu = 0, whatever sigma
    hits = 0
    trials = 2000
    for _ in range(trials):
        lo, hi = median_interval(list(rng.lognormal(0.0, 0.5, size=101)))
        hits += lo <= true_median <= hi
    assert 0.93 <= hits / trials <= 0.98


def test_verdict_needs_the_whole_interval_under_the_target():
    tight = [1.01 + 0.001 * i for i in range(-10, 11)] * 20
    wide = [1.02 + 0.05 * i for i in range(-10, 11)] * 2
    assert verdict(tight, 1.03) == "met"
    assert verdict(wide, 1.03).startswith("met by the median only")
    assert verdict([1.05] * 50, 1.03) == "MISSED"
    assert verdict([1.0, 1.0, 1.0], 1.03).startswith("met by the median of too few rounds")


def test_paired_ratios_divide_round_by_round():
    ratios = paired_ratios({"base": [1.0, 2.0], "other": [1.5, 2.0]}, "base")
    assert ratios == {"base": [1.0, 1.0], "other": [1.5, 1.0]}


def quick_ratios(monkeypatch, capsys, script: str, *options: str) -> tuple[dict[str, str], str]:
    """Runs a train-step benchmark small; its (candidate: ratio) rows and its output."""
    module = importlib.import_module(script.removesuffix(".py"))
    monkeypatch.setattr(sys, "argv", [script, "--quick", "--width", "32", "--depth", "1",
                                      "--seq", "16", *options])
    with warnings.catch_warnings():  # a script's warning filters stay in the script's run
        module.main()
    out = capsys.readouterr().out
    return dict(re.findall(r"^  (\S.*?\S)\s+[\d.]+ ms\s+x([\d.]+)", out, re.M)), out


def test_scaler_overhead_prints_every_ratio(monkeypatch, capsys):
    rows, out = quick_ratios(monkeypatch, capsys, "scaler_overhead.py")
    assert list(rows) == ["optax.adam (no scaling)", "jamp.loss_scaled(adam)",
                          "jamp.loss_scaled(adam, skip='cond')", "optax.apply_if_finite(adam)",
                          "flax DynamicScale + adam"]
    assert float(rows["optax.adam (no scaling)"]) == 1.0
    assert all(float(r) > 0 for r in rows.values())
    assert "(target <= 1.03: " in out


def test_anomaly_overhead_prints_every_ratio(monkeypatch, capsys):
    rows, _ = quick_ratios(monkeypatch, capsys, "anomaly_overhead.py")
    assert list(rows) == ["plain step", "step inside detect_anomaly()",
                          "anomaly_checked loss in detect_anomaly()"]
    assert float(rows["plain step"]) == 1.0
    assert all(float(r) > 0 for r in rows.values())


def test_fp8_overhead_prints_every_ratio(monkeypatch, capsys):
    # The step timing alone: the compile timing clears jax's caches and compiles every step
    # again, which a smoke run need not pay for.
    rows, out = quick_ratios(monkeypatch, capsys, "fp8_overhead.py", "--compile-rounds", "0")
    assert list(rows) == ["bfloat16 autocast step", "fp8 tensorwise step (blocks in fp8)",
                          "float32 step"]
    assert float(rows["bfloat16 autocast step"]) == 1.0
    assert all(float(r) > 0 for r in rows.values())
    assert "(target <= 2.00: " in out


def test_autocast_overhead_prints_the_eager_ratio(monkeypatch, capsys):
    rows, out = quick_ratios(monkeypatch, capsys, "autocast_overhead.py", "--eager-only",
                             "--eager-width", "32")
    assert list(rows) == ["plain loss, eager", "jamp.autocast(loss), eager",
                          "jax.grad(loss), eager", "jax.grad(jamp.autocast(loss)), eager"]
    assert float(rows["plain loss, eager"]) == 1.0
    assert all(float(r) > 0 for r in rows.values())
    assert "eager autocast / plain eager" in out and "(target <= 1.50: " in out
