"""Runs the multi-device tests (``tests/sharded/``) in a separate process with 8 CPU devices.

The device count is fixed when XLA starts, so these tests cannot share this process (one
device) with the rest of the suite. The child's report is shown when it fails.
"""

import os
import pathlib
import re
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


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(script, port, timeout=600):
    """Run ``script PROCESS_ID PORT`` as processes 0 and 1; ``[(returncode, output)]``. A process
    still running after ``timeout`` seconds is killed."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=HERE.parent,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return [
        (proc.returncode, "\n".join(line for line in out.splitlines() if "[Gloo]" not in line))
        for proc, out in zip(procs, outputs)
    ]


def test_row_sharded_training_across_two_processes(tmp_path):
    """``jax.distributed`` with 2 processes x 4 CPU devices (gloo collectives): the row-sharded
    training step (a stacked table with lazy Adam; two tables with lazy Adam and catch-up) equals
    the one-device training in every shard each process holds. The test starts both processes and
    stops them (a process still running after the timeout is killed)."""
    for code, out in _two_processes(HERE / "sharded" / "multiprocess_worker.py", _free_port()):
        assert code == 0, out[-6000:]
        assert "OK stacked table, lazy adam" in out and "OK two tables, lazy adam with catch-up" in out, out[-6000:]
    # docs/sharding.md's launch script, as written (its coordinator port made free)
    text = (HERE.parent / "docs" / "sharding.md").read_text()
    script = re.search(r"```py\n(.*?)```", text, flags=re.S).group(1)
    port = _free_port()
    (tmp_path / "train.py").write_text(script.replace('"localhost:12345"', f'"localhost:{port}"'))
    for code, out in _two_processes(tmp_path / "train.py", port):
        assert code == 0, out[-6000:]


def test_importing_the_library_starts_no_xla_backend():
    """``jax.distributed.initialize`` must come before anything starts an XLA backend; importing
    masked_jax (every public package) starts none, so it may come after the imports."""
    code = (
        "from jax._src import xla_bridge as xb\n"
        "import masked_jax, masked_jax.numpy, masked_jax.nn, masked_jax.optim, masked_jax.checking\n"
        "import masked_jax.embeddings, masked_jax.layouts, masked_jax.testing\n"
        "assert not xb._backends, sorted(xb._backends)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
