"""``make demo`` tours the three jobs with the runtime dependencies only, and prints what it promises."""

import pathlib
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_make_demo_tours_the_three_jobs():
    """The README's first command, as a user types it (the venv already exists under make test)."""
    assert shutil.which("make"), "make is required by the README's commands"
    proc = subprocess.run(["make", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "True = valid" in out
    assert "mean over rows     MaskedArray([2.0 --], dtype=float32)" in out
    assert "entries that changed:  [[True, False, True], [False, False, True]]" in out  # the valid ones
    losses = [float(v) for v in out.split("loss:")[1].split("(")[0].split()]
    assert len(losses) >= 5 and losses[-1] < losses[0]  # training goes down
    assert "row-sparse" in out and "dense adam" in out
    assert "mnn.softmax on a masked input satisfies: masked" in out
    assert "(masked entries leak in) satisfies: dense" in out or "(masked entries leak in) satisfies: neither" in out
    seq, ref = (line.split(":", 1)[1] for line in out.splitlines() if line.strip().startswith("sequence 1"))
    assert seq.strip() == ref.strip()  # maskify on padding = the unpadded run
    assert "any NaN: False" in out
