"""`examples/multihost.py --local-processes` as a shell or CI runs it: its exit status says
whether every process of the job succeeded."""

import os
import pathlib
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "multihost.py"
TINY = ["--local-processes", "2", "--devices-per-process", "1", "--steps", "1", "--batch", "2",
        "--seq", "8", "--width", "8", "--depth", "1", "--log-every", "1"]


def launch(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *TINY, *extra], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_a_process_that_dies_fails_the_launcher():
    # The second process kills itself after the first step; the launcher then kills the first.
    run = launch("--crash-at", "1:1")
    assert "(exit -9)" in run.stdout
    assert run.returncode != 0
    assert "the job failed" in run.stderr


def test_a_job_whose_processes_all_succeed_exits_0():
    run = launch()
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("(exit 0)") == 2
