"""The guides in docs/ agree with the code, where a machine can tell.

What the pages name exists (paths, ``masked_jax.*`` names); the code blocks of the contributor
guides import public names only, and ``docs/adding_ops.md``'s registrations give working ops; a
package docstring that lists its modules lists all of them; the pages read as guides: no history,
no timings (those live in git and in ``benchmarks/README.md``). The layers the pages give are
checked by ``tests/test_layers.py``.
"""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "masked_jax"
# the pages written here (the docs site copies benchmarks/README.md into docs/ when it is built)
DOCS = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")
GUIDES = [ROOT / "docs" / "adding_ops.md", ROOT / "docs" / "architecture.md"]  # for contributors
SUBPACKAGES = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}


def _backticked(text: str) -> list[str]:
    return [t.strip().rstrip(",.:;") for t in re.findall(r"`([^`\n]+)`", text)]


def _python_blocks(path: pathlib.Path) -> list[str]:
    """The page's ``python`` code blocks that are whole programs (not fragments such as a table row)."""
    blocks = []
    for block in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S):
        try:
            ast.parse(block)
        except SyntaxError:
            continue
        blocks.append(block)
    return blocks


def _registered_by_examples() -> set[str]:
    """The op names docs/adding_ops.md's examples register (they exist once its code has run)."""
    code = "\n".join(_python_blocks(GUIDES[0]))
    return set(re.findall(r'unary_spec\("(\w+)"', code)) | set(re.findall(r'name="(\w+)"', code))


def test_paths_the_docs_name_exist():
    """A path in backticks (``tests/harness.py``, ``masked_jax/ops/_registry.py``, or relative to
    the package: ``layouts/_dispatch.py``) names a file or folder of the repository."""
    missing, seen = [], 0
    for page in DOCS:
        for token in _backticked(page.read_text()):
            if not re.fullmatch(r"[\w.-]+(/[\w.-]*)+", token):
                continue
            first = token.split("/")[0]
            if first in ("masked_jax", "tests", "benchmarks", "docs"):
                path = ROOT / token
            elif first in SUBPACKAGES:
                path = PACKAGE / token
            else:
                continue  # another project's path (jax/_src/numpy)
            seen += 1
            if not path.exists():
                missing.append(f"{page.name}: {token}")
    assert seen > 20, seen
    assert not missing, f"the docs name paths that do not exist: {missing}"


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def test_names_the_docs_give_resolve():
    """``masked_jax.numpy.mean``, ``masked_jax.optim.lazy``, ...: a module, or a name in one."""
    examples = _registered_by_examples()
    wrong, seen = [], 0
    for page in DOCS:
        for token in _backticked(page.read_text()):
            m = re.match(r"masked_jax(\.\w+)+", token)
            if not m or m.group(0).rsplit(".", 1)[-1] in examples:
                continue
            seen += 1
            try:
                _resolve(m.group(0))
            except (ImportError, AttributeError) as err:
                wrong.append(f"{page.name}: {m.group(0)} ({err})")
    assert seen > 20, seen
    assert not wrong, f"the docs give names that do not exist: {wrong}"


def test_the_guides_import_public_names_that_work():
    """Every import of ``masked_jax`` in the guides' code is of a public module and a public name."""
    imports = []
    for page in GUIDES:
        for block in _python_blocks(page):
            for node in ast.walk(ast.parse(block)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("masked_jax"):
                    imports.append((page.name, node.module, [a.name for a in node.names], node))
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.startswith("masked_jax"):
                            imports.append((page.name, a.name, [], node))
    assert len(imports) >= 3, imports
    private = [
        f"{page}: {module} {names}"
        for page, module, names, _ in imports
        if any(part.startswith("_") for part in module.split(".")) or any(n.startswith("_") for n in names)
    ]
    assert not private, f"the guides import private modules or names: {private}"
    for page, _, _, node in imports:
        exec(compile(ast.Module(body=[node], type_ignores=[]), page, "exec"), {})


def test_the_adding_ops_examples_register_working_ops():
    """docs/adding_ops.md's registrations, run as a user runs them (a process of their own: they
    change the registry), give ``masked_jax.numpy`` functions, methods and sparse storage."""
    check = """
import jax.numpy as jnp, numpy as np
import masked_jax as mj, masked_jax.numpy as mnp
x = mj.masked_array(jnp.array([[1.0, 2.0, 3.0], [4.0, jnp.nan, 6.0]]),
                    jnp.array([[True, True, False], [True, False, True]]))
y = mnp.log10_1p(x)
np.testing.assert_allclose(np.asarray(y.data)[x.mask], np.log10(1 + np.array([1.0, 2.0, 4.0, 6.0])), rtol=1e-6)
np.testing.assert_array_equal(np.asarray(y.mask), np.asarray(x.mask))
s = mnp.sumsq(x, axis=1)
np.testing.assert_allclose(np.asarray(s.data), [5.0, 52.0])
np.testing.assert_allclose(np.asarray(x.sumsq(axis=1).data), [5.0, 52.0])
b = mnp.sumsq(x.tostype("bcoo"), axis=1)
assert b.storage == "bcoo", b.storage
np.testing.assert_allclose(np.asarray(b.todense().data), [5.0, 52.0])
print("ok")
"""
    program = "\n".join(_python_blocks(GUIDES[0])) + check
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_ENABLE_X64", None)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("page", GUIDES, ids=[p.name for p in GUIDES])
def test_the_guides_name_every_harness_check(page):
    """The harness's checks are named, not counted: a count would go stale with the next check."""
    from masked_jax.ops._registry import CHECKS

    text = page.read_text()
    missing = [c for c in CHECKS if f"`{c}`" not in text]
    assert not missing, f"docs/{page.name} does not name the harness checks {missing}"


@pytest.mark.parametrize("package", sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()))
def test_a_package_docstring_that_lists_modules_lists_every_one(package):
    """A package docstring's list of its private modules (``* ``_api``: ...``) names each one."""
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text())) or ""
    listed = re.findall(r"^\* ``(_\w+)``:", doc, flags=re.M)
    if package == "_maskify":
        assert listed, "the maskify package's docstring lists its modules"
    if not listed:
        return
    modules = sorted(p.stem for p in (PACKAGE / package).glob("_*.py") if p.name != "__init__.py")
    assert sorted(listed) == modules, f"masked_jax/{package}/__init__.py lists {sorted(listed)}; has {modules}"


HISTORY = re.compile(
    r"\b(before this round|this round|last round|previous round|used to|previously|formerly|no longer|"
    r"until recently|the run before|an earlier version|in the past)\b",
    flags=re.I,
)
TIMING = re.compile(r"\b\d+(\.\d+)?\s?(ms|µs|us|ns|s|sec|seconds|minutes)\b")


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_the_pages_are_guides_with_no_history_and_no_timings(page):
    """History lives in git, measured times in benchmarks/README.md."""
    found = []
    for i, line in enumerate(page.read_text().splitlines(), 1):
        for pattern in (HISTORY, TIMING):
            m = pattern.search(line)
            if m:
                found.append(f"{page.name}:{i}: {m.group(0)!r}")
    assert not found, f"history or timings in a guide: {found}"
