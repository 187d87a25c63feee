"""Test-wide set-up: eight CPU devices, so sharding tests run on any machine.

XLA reads this flag once, when the backend starts, so it is set before anything imports jax.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
