"""Every public function and class documents itself with an example that runs and is right."""

from __future__ import annotations

import doctest
import inspect

import jax
import pytest

import masked_jax as mj
import masked_jax.nn as mnn
import masked_jax.numpy as mnp
import masked_jax.testing as mtesting
from masked_jax import optim
from masked_jax.numpy import _metadata


def _public():
    items = []
    for mod in (mj, mnp, mnn, optim, mtesting):
        for name in getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]:
            obj = getattr(mod, name)
            if callable(obj) and not inspect.ismodule(obj) and name not in _metadata.DTYPES:  # jax's dtypes
                items.append((f"{mod.__name__}.{name}", obj))
    items.append(("masked_jax.MaskedArray", mj.MaskedArray))
    for meth in ("filled", "count", "to_numpy_ma", "at"):
        items.append((f"MaskedArray.{meth}", getattr(mj.MaskedArray, meth)))
    for meth in ("save_html", "plot"):
        items.append((f"JacobianReport.{meth}", getattr(mj.JacobianReport, meth)))
    items.append(("InvarianceReport.save_html", mj.InvarianceReport.save_html))
    items += [("masked_jax.numpy", mnp), ("masked_jax.nn", mnn), ("masked_jax.optim", optim)]
    return items


@pytest.fixture
def default_precision():
    """Examples are written for a user's default config: x64 off."""
    jax.config.update("jax_enable_x64", False)
    yield
    jax.config.update("jax_enable_x64", True)


@pytest.mark.usefixtures("default_precision")
@pytest.mark.parametrize("name,obj", _public(), ids=lambda v: v if isinstance(v, str) else "")
def test_docstring_has_runnable_example(name, obj):
    doc = inspect.getdoc(obj)
    assert doc and ">>>" in doc, f"{name} has no example in its docstring"
    test = doctest.DocTestParser().get_doctest(doc, {}, name, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    runner.run(test)
    assert runner.failures == 0, f"example of {name} failed"
