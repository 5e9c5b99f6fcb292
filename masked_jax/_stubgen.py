"""Write the type stubs of the registry-built API: ``numpy/__init__.pyi``, ``nn.pyi`` and ``_core/_methods.pyi``.

The functions of ``masked_jax.numpy`` / ``masked_jax.nn`` and the methods of every masked array
class are built at import time from the op registry, so static tools (pyright, mypy, editors)
cannot see them in the source. These stubs declare them with the same signatures the runtime
functions report (``inspect.signature``). ``python -m masked_jax._stubgen`` rewrites them;
``tests/test_typing.py`` fails when they drift from the registry.
"""

from __future__ import annotations

import inspect
import pathlib
import sys

import masked_jax  # noqa: F401  (registers every op and builds the modules)
from masked_jax import nn, numpy
from masked_jax._core import ArrayMethods
from masked_jax.numpy import (
    _contractions,
    _creation,
    _dtypes,
    _frontend,
    _metadata,
    _misc,
    _reductions,
    _searching,
    _setops,
    _stacking,
)

# the topic modules of masked_jax.numpy: their functions are typed in their own source
TOPICS = (_metadata, _creation, _dtypes, _contractions, _stacking, _reductions, _setops, _searching, _misc)
HOMES = {name: module.__name__ for module in TOPICS for name in module.__all__}

HERE = pathlib.Path(__file__).parent
HEADER = """# Generated from the op registry by `python -m masked_jax._stubgen`; do not edit.
from __future__ import annotations

from typing import Any, Sequence

from jax import Array
from jax.typing import ArrayLike, DTypeLike

from masked_jax._core import MaskedArray

Axis = int | Sequence[int] | None
Shape = int | Sequence[int]
"""


def _param(p: inspect.Parameter) -> str:
    ann = p.annotation if p.annotation is not inspect.Parameter.empty else "Any"
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(p.kind, "")
    default = " = ..." if p.default is not inspect.Parameter.empty else ""
    return f"{prefix}{p.name}: {ann}{default}"


def render_signature(sig: inspect.Signature, first: str | None = None) -> str:
    """``(params) -> return`` with ``/`` and ``*`` markers, annotations as written, defaults ``...``."""
    parts = [] if first is None else [first]
    kinds = [p.kind for p in sig.parameters.values()]
    star_done = inspect.Parameter.VAR_POSITIONAL in kinds
    for i, p in enumerate(sig.parameters.values()):
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        parts.append(_param(p))
        nxt = kinds[i + 1] if i + 1 < len(kinds) else None
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and nxt is not inspect.Parameter.POSITIONAL_ONLY:
            parts.append("/")
    ret = sig.return_annotation if sig.return_annotation is not inspect.Signature.empty else "Any"
    return f"({', '.join(parts)}) -> {ret}"


def _module_stub(module, extra: str = "") -> str:
    lines = [HEADER]
    reexports = []
    for name in sorted(module.__all__):
        obj = getattr(module, name)
        spec = getattr(obj, "spec", None)
        if spec is not None:
            lines.append(f"def {name}{render_signature(inspect.signature(obj))}: ...")
        elif getattr(obj, "__module__", "").startswith("masked_jax._core"):
            reexports.append(f"from masked_jax._core import {obj.__name__} as {name}")
        elif name in HOMES:  # typed in their own source
            reexports.append(f"from {HOMES[name]} import {name} as {name}")
        elif inspect.ismodule(obj):  # linalg, fft: real submodules, typed in their own source
            reexports.append(f"from {obj.__name__.rsplit('.', 1)[0]} import {name} as {name}")
        elif inspect.isfunction(obj) and obj.__name__ == name:
            lines.append(f"def {name}{render_signature(inspect.signature(obj))}: ...")
        elif inspect.isfunction(obj):
            lines.append(f"{name} = {obj.__name__}")
        else:
            raise TypeError(f"stubgen: cannot declare {module.__name__}.{name} ({type(obj).__name__}).")
    return "\n".join(lines[:1] + reexports + lines[1:]) + "\n" + extra


def _methods_stub() -> str:
    lines = [
        HEADER,
        "from typing import TypeVar",
        "",
        '_Self = TypeVar("_Self")',
        "",
        "def method_example(call: str, result: str) -> str: ...",
        "",
        "class ArrayMethods:",
    ]
    for name in sorted(n for n, m in vars(ArrayMethods).items() if hasattr(m, "op_name")):
        fn = _frontend.function(getattr(ArrayMethods, name).op_name)
        if name in _frontend._UNARY_DUNDERS:
            lines.append(f"    def {name}(self) -> MaskedArray: ...")
        elif name in ("__eq__", "__ne__"):
            lines.append(f"    def {name}(self, other: object) -> MaskedArray: ...  # type: ignore[override]")
        elif name.startswith("__"):
            lines.append(
                f"    def {name}(self, other: ArrayLike | MaskedArray) -> {_frontend.RETURNS[vars(fn)['spec'].returns]}: ..."
            )
        elif name in _frontend._VARARG_METHODS:
            lines.append(f"    def {name}(self, *args: Any, **kwargs: Any) -> MaskedArray: ...")
        else:
            sig = inspect.signature(fn)
            rest = sig.replace(parameters=list(sig.parameters.values())[1:])
            lines.append(f"    def {name}{render_signature(rest, first='self')}: ...")
    for name, member in sorted(vars(ArrayMethods).items()):  # written by hand (_methods, _array_methods)
        if isinstance(member, property):
            lines += ["    @property", f"    def {name}(self) -> {member.fget.__annotations__['return']}: ..."]
        elif inspect.isfunction(member) and not hasattr(member, "op_name"):
            sig = inspect.signature(member)
            this, *others = sig.parameters.values()
            first = "self" if this.annotation is inspect.Parameter.empty else f"self: {this.annotation}"
            lines.append(f"    def {name}{render_signature(sig.replace(parameters=others), first=first)}: ...")
    return "\n".join(lines) + "\n"


def _namespace_extra() -> str:
    return (
        "\nfrom masked_jax.numpy._metadata import __array_namespace_info__ as __array_namespace_info__\n"
        "__array_api_version__: str\n"
    )


def stubs() -> dict[pathlib.Path, str]:
    """Stub file -> its text, as generated from the registry now."""
    return {
        HERE / "numpy" / "__init__.pyi": _module_stub(numpy, _namespace_extra()),
        HERE / "nn.pyi": _module_stub(nn),
        HERE / "_core" / "_methods.pyi": _methods_stub(),
    }


def main(argv=None) -> int:
    for path, text in stubs().items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
