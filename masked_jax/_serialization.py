"""flax serialization of the array classes, registered when flax is imported (no dependency on it).

``flax.serialization.to_bytes`` / ``from_bytes`` / ``to_state_dict`` walk a tree by registered
types; a class it does not know raises "can not serialize". The masked array classes register a
state dict of their named children (``data`` and ``mask``, or ``data`` and ``indices``) as soon as
``flax.serialization`` is imported: now, if it already is, or else by a one-shot import hook.
pickle, npz (through ``jax.tree_util.tree_flatten_with_path``) and orbax need nothing: the classes
are pytrees with named children.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

import jax.numpy as jnp

from masked_jax._core import MaskedArray
from masked_jax.layouts import BCOOMaskedArray, RowSparseArray

_MODULE = "flax.serialization"


def _classes():
    return (MaskedArray, BCOOMaskedArray, RowSparseArray)


def _to_state(x):
    children, _ = x.tree_flatten_with_keys()
    return {key.name: value for key, value in children}


def _from_state(target, state):
    children, aux = target.tree_flatten_with_keys()
    missing = [key.name for key, _ in children if key.name not in state]
    if missing:
        raise ValueError(f"restoring a {type(target).__name__}: the state has no {missing}; got keys {sorted(state)}.")
    values = (state[key.name] for key, _ in children)  # a statically valid array's mask is None
    return type(target).tree_unflatten(aux, tuple(None if v is None else jnp.asarray(v) for v in values))


def register(serialization) -> None:
    """Register the array classes with a ``flax.serialization`` module."""
    for cls in _classes():
        serialization.register_serialization_state(cls, _to_state, _from_state, override=True)


class _ImportHook(importlib.abc.MetaPathFinder):
    """Registers the classes right after ``flax.serialization`` is first imported."""

    def find_spec(self, name, path=None, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # one shot; the real finders locate the module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            register(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Register now if flax.serialization is loaded, else when it is."""
    if _MODULE in sys.modules:
        register(sys.modules[_MODULE])
    elif importlib.util.find_spec("flax") is not None and not any(isinstance(f, _ImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook())


__all__ = ["install", "register"]
