"""Set-up for the multi-device tests: 8 simulated CPU devices.

These tests run in their own process (``tests/test_sharding.py`` starts it), because the
device count is fixed when the XLA backend starts: the rest of the suite keeps one device.
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
