"""``make demo`` runs the tour; it must exit 0 and print the masked semantics it promises."""

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_demo_runs_and_prints_the_tour():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "masked_jax.demo"], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout
    assert "True = valid" in out
    assert "mean over rows     MaskedArray([2.0 --], dtype=float32)" in out
    assert "d/dx sum(log(x)) = [[1.0, 0.0, 0.3333333432674408], [0.0, 0.0, 0.0]]" in out
    assert "nan" not in out and "inf" not in out.replace("-inf sit", "")  # no value leaks


def test_make_demo_target_exits_zero():
    """The README's first command, as a user types it (the venv already exists under make test)."""
    assert shutil.which("make"), "make is required by the README's commands"
    proc = subprocess.run(["make", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "masked_jax" in proc.stdout and "mean over rows" in proc.stdout
