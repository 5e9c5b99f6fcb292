"""The registry-built API is visible to static tools: generated stubs in sync, pyright clean."""

from __future__ import annotations

import inspect
import json
import pathlib
import shutil
import subprocess
import sys

import jax.numpy as jnp
import pytest

import masked_jax as mj
import masked_jax.numpy as mnp
from masked_jax import _stubgen

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_stubs_are_in_sync_with_the_registry():
    for path, text in _stubgen.stubs().items():
        assert path.read_text() == text, f"{path.name} is stale: run `python -m masked_jax._stubgen`"
    assert (ROOT / "masked_jax" / "py.typed").exists()


def test_runtime_signatures_are_jax_numpy_signatures():
    """Parameter names, kinds and defaults of every mirrored function are jax.numpy's."""
    checked = 0
    for name in mnp.__all__:
        fn, ref = getattr(mnp, name), getattr(jnp, name, None)
        spec = getattr(fn, "spec", None)
        if spec is None or ref is None or spec.family in ("binary",) or name == "where" or fn.__name__ != name:
            continue  # (an Array API alias, such as acos for arccos, is checked under its own name)
        try:
            want = inspect.signature(ref)
        except (TypeError, ValueError):
            continue
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in want.parameters.values()) and name != "einsum":
            continue  # jnp ufuncs take (*args): ours are (x, /) and (x1, x2, /)
        want_params = [
            (p.name, p.kind, p.default)
            for p in want.parameters.values()
            if not p.name.startswith("_") and p.name != "out_sharding"
        ]
        got = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
        assert got == want_params, name
        checked += 1
    assert checked >= 40
    assert "keepdims" in str(inspect.signature(mnp.mean)) and "(a:" in str(inspect.signature(mnp.mean))


def test_unsupported_jnp_parameters_raise_at_non_default_values():
    x = mj.masked_array(jnp.ones(3), jnp.array([True, False, True]))
    with pytest.raises(TypeError, match=r"initial=1.0 is not supported"):
        mnp.sum(x, initial=1.0)
    with pytest.raises(TypeError, match=r"out=.* is not supported"):
        mnp.mean(x, out=jnp.zeros(()))
    assert float(mnp.sum(x, initial=None).data) == 2.0  # the default is accepted
    with pytest.raises(TypeError, match=r"masked_jax.numpy.mean\(a, axis=None.*unexpected keyword argument 'axes'"):
        mnp.mean(x, axes=0)


@pytest.mark.skipif(
    shutil.which("node") is None and not (pathlib.Path(sys.executable).parent / "pyright").exists(),
    reason="pyright is installed by the test extra",
)
def test_pyright_reports_no_error_on_a_user_script(tmp_path):
    script = ROOT / "tests" / "typing" / "user_script.py"
    (tmp_path / "user_script.py").write_text(script.read_text())
    (tmp_path / "pyrightconfig.json").write_text(
        json.dumps(
            {
                "typeCheckingMode": "basic",
                "extraPaths": [str(ROOT)],
                "pythonVersion": "3.11",
            }
        )
    )
    pyright = pathlib.Path(sys.executable).parent / "pyright"
    proc = subprocess.run(
        [str(pyright), "--pythonpath", sys.executable, "--outputjson", "user_script.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(proc.stdout)
    errors = [d for d in report["generalDiagnostics"] if d["severity"] == "error"]
    assert report["summary"]["filesAnalyzed"] == 1
    assert not errors, "\n".join(f"{d['range']['start']['line'] + 1}: {d['message']}" for d in errors)
