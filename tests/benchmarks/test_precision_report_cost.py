"""benchmarks/precision_report_cost.py runs small and prints its ratio against the target."""

import pathlib
import re
import subprocess
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def test_precision_report_cost_prints_its_ratio():
    result = subprocess.run([sys.executable, "precision_report_cost.py", "--quick"],
                            cwd=BENCHMARKS, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = dict(re.findall(r"^  (\S.*?\S)\s+[\d.]+ ms\s+x([\d.]+)", result.stdout, re.M))
    assert list(rows) == ["float32 step (trace, compile, run)", "precision_report (float16)"]
    assert float(rows["float32 step (trace, compile, run)"]) == 1.0
    assert float(rows["precision_report (float16)"]) > 0
    assert "(target <= 3.00: " in result.stdout
    assert re.search(r"the report's summary: no module overflows float16", result.stdout)
