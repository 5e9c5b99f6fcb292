"""Runs the multi-device tests (``tests/sharded/``) in a separate process with 8 CPU devices.

The device count is fixed when XLA starts, so these tests cannot share this process (one
device) with the rest of the suite. The child's report is shown when it fails.
"""

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def test_sharded_suite_on_8_cpu_devices():
    env = dict(
        os.environ,
        MASKED_JAX_SHARDED_TESTS="1",
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip(),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "sharded")],
        env=env,
        capture_output=True,
        text=True,
        cwd=HERE.parent,
    )
    assert proc.returncode == 0, proc.stdout[-12000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-4000:]
