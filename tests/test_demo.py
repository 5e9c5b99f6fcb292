"""``make demo`` runs the tour; it must exit 0 and print the masked semantics it promises."""

import os
import subprocess
import sys


def test_demo_runs_and_prints_the_tour():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "masked_jax.demo"], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout
    assert "True = valid" in out
    assert "mean over rows     MaskedArray([2.0 --], dtype=float32)" in out
    assert "d/dx sum(log(x)) = [[1.0, 0.0, 0.3333333432674408], [0.0, 0.0, 0.0]]" in out
    assert "nan" not in out and "inf" not in out.replace("-inf sit", "")  # no value leaks
