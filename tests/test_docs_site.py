"""The documentation site builds in strict mode (warnings are errors), with every notebook executed
at build time: the notebooks print what their prose promises and draw their figures, and the API
reference documents every public name."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import masked_jax as mj
import masked_jax.nn as mnn
import masked_jax.numpy as mnp
from masked_jax import optim

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = {  # text each notebook must print, and how many figures it must draw
    "row_sparse.ipynb": (
        ["RowSparseArray(float32[5, 2], rows=2)", "strict:", "RowSparseArray [0, 3]", "K =  8192: lazy"],
        1,
    ),
    "masked_adagrad.ipynb": (["same as by hand: True", "bcoo, jit: True", "x faster"], 1),
    "jacobian_check.ipynb": (
        [
            "('masked',)",
            "('dense',)",
            "fix passes: ('dense', 'masked')",
            "<-- mismatch",
            "forward mode skipped",
            "fast: True passed: True",
            "4.",
            "31.",
            "leak: args[0][0, 1] -> out[] through gradient",
        ],
        2,
    ),
}


@pytest.fixture(scope="module")
def site(tmp_path_factory, worker_id):
    """The built site. Under pytest-xdist the workers share one build (the session's temporary
    directory, under a lock): the build executes every notebook, a minute of the machine's time."""
    if worker_id == "master":
        return _build(tmp_path_factory.mktemp("site"))
    import fcntl

    shared = tmp_path_factory.getbasetemp().parent  # this session's, above each worker's own
    out = shared / "docs_site"
    with open(shared / "docs_site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "built").exists():
            _build(out)
            (out / "built").touch()
    return out


def _build(out):
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    env.pop("MPLBACKEND", None)  # the notebooks' kernels draw with Jupyter's inline backend
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "-d",
            str(out / "doctrees"),
            "docs",
            str(out / "html"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, f"the docs build failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    return out


def test_every_notebook_is_in_the_site_and_expected():
    assert NOTEBOOKS and set(NOTEBOOKS) == set(EXPECTED)
    index = (ROOT / "docs" / "index.md").read_text()
    for name in NOTEBOOKS:
        assert f"notebooks/{name[: -len('.ipynb')]}" in index, f"{name} is not in the site's table of contents"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executed_at_build_time_prints_and_plots(site, name):
    nb = json.loads((site / "jupyter_execute" / "notebooks" / name).read_text())
    outputs = [out for cell in nb["cells"] if cell["cell_type"] == "code" for out in cell.get("outputs", [])]
    assert not [o for o in outputs if o["output_type"] == "error"]
    text = "\n".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", "")) for o in outputs)
    needles, figures = EXPECTED[name]
    for needle in needles:
        assert needle in text, f"{name} should print {needle!r}"
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) >= figures, f"{name} should draw {figures} figure(s), drew {len(pngs)}"
    page = (site / "html" / "notebooks" / name.replace(".ipynb", ".html")).read_text()
    assert page.count("<img") >= figures, f"the site's {name} page shows no figure"


@pytest.mark.parametrize("module,page", [(mj, "masked_jax"), (mnp, "numpy"), (mnn, "nn"), (optim, "optim")])
def test_api_reference_documents_every_public_name(site, module, page):
    html = (site / "html" / "api" / f"{page}.html").read_text()
    names = getattr(module, "__all__", None) or [
        n for n in dir(module) if not n.startswith("_") and not isinstance(getattr(module, n), type(mj))
    ]
    missing = [n for n in names if f'id="{module.__name__}.{n}"' not in html]
    assert not missing, f"the API reference of {module.__name__} misses {missing}"


def test_guides_are_pages_of_the_site(site):
    for md in sorted((ROOT / "docs").glob("*.md")):
        if md.name != "benchmarks.md":  # copied in from benchmarks/README.md at build time
            assert (site / "html" / md.name.replace(".md", ".html")).exists(), f"{md.name} is not built"
    assert (site / "html" / "benchmarks.html").exists()
