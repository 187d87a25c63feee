"""benchmarks/precision_report_cost.py runs small, in this process (as `python
precision_report_cost.py --quick` would: no second jax start-up), and prints its ratio against
the target."""

import pathlib
import re
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import precision_report_cost  # noqa: E402


def test_precision_report_cost_prints_its_ratio(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["precision_report_cost.py", "--quick"])
    precision_report_cost.main()
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^  (\S.*?\S)\s+[\d.]+ ms\s+x([\d.]+)", out, re.M))
    assert list(rows) == ["float32 step (trace, compile, run)", "precision_report (float16)"]
    assert float(rows["float32 step (trace, compile, run)"]) == 1.0
    assert float(rows["precision_report (float16)"]) > 0
    assert "(target <= 3.00: " in out
    assert re.search(r"the report's summary: no module overflows float16", out)
