"""The package's layers, as docs/architecture.md draws them, kept by its imports.

The layers are read from the page's picture (its ``layer N`` lines), so the page is the one list.
Every import is counted, also one inside a function. A module imports only from its own layer or
below, never from a sibling package of its layer, no import points up, and the module graph has
no cycle. An import inside a function is allowed only where a comment on that line or the line
above says why. The layer numbers the page's module tree (``L3``) and the package docstrings
(``Layer 3``) give agree with the picture.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "masked_jax"
PAGE = (ROOT / "docs" / "architecture.md").read_text()


def _module_named(token: str) -> str:
    """``ops/`` -> ``masked_jax.ops``, ``_ad.py`` -> ``masked_jax._ad``, ``__init__.py`` -> ``masked_jax``."""
    if token == "__init__.py":
        return "masked_jax"
    return "masked_jax." + token.removesuffix("/").removesuffix(".py")


def layers_of_the_page(text: str) -> list[list[str]]:
    """The layers, low to high, from the page's first code block: each line ``layer N`` names the
    modules and packages (``ops/``, ``_ad.py``) of layer N."""
    picture = text.split("```", 2)[1]
    layers: dict[int, list[str]] = {}
    for line in picture.splitlines():
        m = re.match(r"\s*layer (\d+)\s(.*)", line)
        if m:
            tokens = re.findall(r"(?<![\w./])(\w+/|\w+\.py)(?!\w)", m.group(2))
            layers[int(m.group(1))] = [_module_named(t) for t in tokens]
    assert sorted(layers) == list(range(len(layers))), f"docs/architecture.md: layers {sorted(layers)}"
    return [layers[i] for i in range(len(layers))]


# low to high; siblings in one layer must not import each other
LAYERS = layers_of_the_page(PAGE)


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _target(name: str) -> str:
    """The module an import of ``name`` lands on (a name inside a module: that module)."""
    while name not in MODULES:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(name: str, path: pathlib.Path):
    """(imported module, line number, at module level?) for each internal import of a module."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    top = {id(n) for n in tree.body}
    top |= {id(n) for stmt in tree.body if isinstance(stmt, (ast.If, ast.Try)) for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        if isinstance(node, ast.If) or any(n.startswith("masked_jax") for n in names) is False:
            continue
        type_checking = False
        for stmt in ast.walk(tree):
            if (
                isinstance(stmt, ast.If)
                and "TYPE_CHECKING" in ast.unparse(stmt.test)
                and any(n is node for n in ast.walk(stmt))
            ):
                type_checking = True
        if type_checking:
            continue
        for n in names:
            if n == "masked_jax" or n.startswith("masked_jax."):
                yield _target(n), node.lineno, id(node) in top


def _layer(module: str) -> tuple[int, str]:
    best = None
    for i, layer in enumerate(LAYERS):
        for pkg in layer:
            if module == pkg or module.startswith(pkg + "."):
                if best is None or len(pkg) > len(best[1]):
                    best = (i, pkg)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return best


GRAPH = {m: sorted({t for t, _, _ in _imports(m, p) if t != m}) for m, p in MODULES.items()}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module):
    level, home = _layer(module)
    for target in GRAPH[module]:
        t_level, t_home = _layer(target)
        assert t_level < level or t_home == home, (
            f"{module} (layer {level}, {home}) imports {target} (layer {t_level}, {t_home}): "
            "a module imports from its own package or from a lower layer only"
        )


def test_the_module_graph_has_no_cycle():
    edges = GRAPH
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in edges[m]:
            if state.get(t) == 1:
                cycle = stack[stack.index(t) :] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_every_import_inside_a_function_says_why():
    missing = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        for _, lineno, at_top in _imports(module, path):
            if at_top:
                continue
            here, above = lines[lineno - 1], lines[lineno - 2] if lineno > 1 else ""
            if "#" not in here and not above.strip().startswith("#"):
                missing.append(f"{path.relative_to(ROOT)}:{lineno}")
    assert not missing, f"imports inside functions without a comment that says why: {missing}"


def _listed_modules(text: str) -> set[str]:
    """The modules in the page's tree (the code block that starts with ``masked_jax/``): a folder
    line (``  ops/``) holds the module lines indented below it, each line starting with modules."""
    block = text.split("```\nmasked_jax/\n", 1)[1].split("```", 1)[0]
    listed, folder = set(), ""
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        tokens = line.split()
        if not tokens:
            continue
        if indent <= 2:
            folder = tokens[0] if tokens[0].endswith("/") else ""
            if folder:
                continue
        for token in tokens:
            if not re.fullmatch(r"\w+\.py", token):
                break
            listed.add(f"masked_jax/{folder if indent > 2 else ''}{token}")
    return listed


def test_the_architecture_page_lists_every_module():
    listed = _listed_modules((ROOT / "docs" / "architecture.md").read_text())
    files = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")}
    missing = sorted(
        f for f in files if f not in listed and not (f.endswith("__init__.py") and f != "masked_jax/__init__.py")
    )
    assert not missing, f"docs/architecture.md does not list: {missing}"
    stale = sorted(listed - files)
    assert not stale, f"docs/architecture.md lists modules that do not exist: {stale}"


def test_the_picture_names_modules_that_exist():
    named = [m for layer in LAYERS for m in layer]
    assert len(LAYERS) > 5 and "masked_jax.ops" in LAYERS[1], LAYERS
    stale = [m for m in named if m not in MODULES]
    assert not stale, f"docs/architecture.md's picture names modules that do not exist: {stale}"
    twice = sorted({m for m in named if named.count(m) > 1})
    assert not twice, f"docs/architecture.md's picture puts modules in two layers: {twice}"


def _layer_of_package(name: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if name in layer)


def test_the_module_tree_gives_the_layers_of_the_picture():
    """A folder or module line of the page's tree may say ``L<n>``: the picture's layer."""
    block = PAGE.split("```\nmasked_jax/\n", 1)[1].split("```", 1)[0]
    said = {}
    for line in block.splitlines():
        m = re.match(r"  (\w+/|\w+\.py)\s+L(\d+)\b", line)
        if m:
            said[_module_named(m.group(1))] = int(m.group(2))
    assert len(said) > 5, said
    wrong = {m: (n, _layer_of_package(m)) for m, n in said.items() if n != _layer_of_package(m)}
    assert not wrong, f"docs/architecture.md's tree gives layers (said, pictured): {wrong}"


def test_package_docstrings_give_the_layers_of_the_picture():
    """A package docstring that names its layer (``Layer 3``) names the picture's."""
    checked, wrong = 0, {}
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        name = f"masked_jax.{init.parent.name}"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for n in re.findall(r"\bLayer (\d+)\b", doc):
            checked += 1
            if int(n) != _layer_of_package(name):
                wrong[name] = (int(n), _layer_of_package(name))
    assert checked >= 4, "the package docstrings name no layer"
    assert not wrong, f"package docstrings give layers (said, pictured): {wrong}"
