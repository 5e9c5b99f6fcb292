"""Public functions and ``MaskedArray`` methods, derived from the op registry.

For every :class:`~masked_jax.ops._registry.OpSpec` this module builds one public function with
the op's real signature (``inspect.signature`` and ``help()`` show ``jax.numpy``'s parameter
names and defaults), installs it in ``masked_jax.numpy`` and/or ``masked_jax.nn``, and binds the
op's methods and operators on :class:`~masked_jax._core.ArrayMethods`, the base of every
masked array class. A registration made later (a new op) is installed the same way at once.

A call binds its arguments to the signature, unwraps operands into ``Pair`` objects (a plain array is
fully valid), AND-s a ``where=`` argument into the mask (reductions and normalizations), refuses a
jnp parameter the masked rule does not implement unless it has its default value, sends sparse
operands to their layout's rule table, and wraps the rule's result.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from masked_jax import _validate, ops
from masked_jax import layouts as dispatch
from masked_jax._core import (
    ArrayMethods,
    MaskedArray,
    SparseMasked,
    from_pair,
    fully_valid_data,
    is_operand,
    unwrap,
    wrap,
)
from masked_jax.ops._base import Pair, and_masks, normalize_axis
from masked_jax.ops._registry import ANNOTATIONS, OPERAND, OpSpec, on_register
from masked_jax.ops.reductions import empty_slices, identity_over_empty

_SEMANTICS = {
    "elementwise": "applied to the data; the mask is unchanged.",
    "binary": "operands broadcast as in ``jax.numpy``; the result is valid where all operands are.",
    "reductions": (
        "computed over valid elements only; an output element is valid iff its slice has a valid "
        "element, and fully masked slices hold a documented fill, never NaN."
    ),
    "normalization": "over the valid elements of ``axis``; masked inputs stay masked.",
    "shape": "applied to data and mask alike: the mask moves with the data.",
    "linalg": (
        "sums over the contracted indices where both operands are valid; an output is valid iff "
        "at least one such index exists."
    ),
}

_EXAMPLES = {
    "elementwise": (
        "x = mj.masked_array(jnp.array([0.5, 2.0]), jnp.array([True, False]))",
        "{mod}.{name}(x).mask",
        "Array([ True, False], dtype=bool)",
    ),
    "binary": (
        "x = mj.masked_array(jnp.array([1, 2]), jnp.array([True, False]))",
        "{mod}.{name}(x, jnp.array([3, 4])).mask",
        "Array([ True, False], dtype=bool)",
    ),
    "reductions": (
        "x = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [False, False]]))",
        "{mod}.{name}(x, axis=1).mask",
        "Array([ True, False], dtype=bool)",
    ),
    "normalization": (
        "x = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [False, False]]))",
        "{mod}.{name}(x, axis=1).mask",
        "Array([[ True, False],\n       [False, False]], dtype=bool)",
    ),
    "shape": (
        "x = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [True, True]]))",
        "{mod}.{name}(x).mask.sum()",
        "Array(3, dtype=int32)",
    ),
    "linalg": (
        "a = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [False, False]]))",
        "{mod}.{name}(a, jnp.ones((2, 2))).mask",
        "Array([[ True,  True],\n       [False, False]], dtype=bool)",
    ),
}

RETURNS = {
    "masked": "MaskedArray",
    "array": "Array",
    "list": "list[MaskedArray]",
    "pair": "tuple[MaskedArray, MaskedArray]",
    "any": "MaskedArray | list[MaskedArray]",
}
_WHERE_FAMILIES = ("reductions", "normalization")
_UNARY_DUNDERS = {"__neg__", "__pos__", "__abs__", "__invert__"}
_VARARG_METHODS = {"reshape", "transpose"}  # x.reshape(2, 3) as x.reshape((2, 3))
_NAMESPACES: dict[str, dict] = {}  # "numpy" / "nn" -> the module's globals
_MODULE_NAMES = {"numpy": "masked_jax.numpy", "nn": "masked_jax.nn"}


def public_signature(spec: OpSpec) -> inspect.Signature:
    """``spec.signature`` with annotations: operands are ``ArrayLike | MaskedArray``."""
    params = []
    operand_names = {n.lstrip("*") for n in spec.operands}
    for p in spec.signature.parameters.values():
        if p.name in operand_names:
            ann = f"Sequence[{OPERAND}]" if spec.sequence else OPERAND
        elif p.name in spec.optional_operands:
            ann = f"{OPERAND} | None"
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            ann = "Any"
        else:
            ann = ANNOTATIONS.get(p.name, "Any")
        params.append(p.replace(annotation=ann))
    return spec.signature.replace(parameters=params, return_annotation=RETURNS[spec.returns])


def docstring(spec: OpSpec, module: str) -> str:
    setup, call, result = spec.example or _EXAMPLES[spec.family]
    summary = spec.summary or f"Masked ``{spec.jax_name}``: {_SEMANTICS[spec.family]}"
    return (
        f"{summary}\n\n"
        "Accepts ``MaskedArray`` objects, sparse masked arrays and plain arrays (fully valid) alike;\n"
        f"the other parameters are those of ``{spec.jax_name}``.\n\n"
        "Examples:\n"
        "    >>> import jax.numpy as jnp, masked_jax as mj\n"
        f"    >>> import {module} as m\n"
        f"    >>> {setup}\n"
        f"    >>> {call.format(mod='m', name=spec.name)}\n" + "".join(f"    {line}\n" for line in result.split("\n"))
    )


def _accepted(rule):
    """The parameter names ``rule`` takes, or ``None`` when it takes any keyword."""
    try:
        params = inspect.signature(rule).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def _as_mask(where, name):
    w = jnp.asarray(where)
    if w.dtype != jnp.bool_:
        raise TypeError(f"{name}: where must be a bool array (True = include); got dtype {w.dtype}.")
    return w


# parameters that take masked arrays (a masked index reads nothing); any other parameter given a
# masked array takes its data when it is fully valid
_MASKED_PARAMETERS = {("take", "indices"), ("take_along_axis", "indices")}


class _Call:
    """The callable behind one public function: binding, unwrapping, dispatch, wrapping."""

    def __init__(self, spec: OpSpec, qualname: str):
        self.spec, self.qualname = spec, qualname
        self.signature = spec.signature
        self.accepted = _accepted(spec.rule)
        self.operand_names = [n.lstrip("*") for n in spec.operands]
        self.variadic = {n.lstrip("*") for n in spec.operands if n.startswith("*")}

    def __call__(self, *args, **kwargs):
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"{self.qualname}{self.signature}: {err}.") from None
        operands, labels, params = [], [], {}
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if name in self.operand_names:
                if name in self.variadic:
                    operands.extend(value)
                    labels.extend(f"{name}[{i}]" for i in range(len(value)))
                elif self.spec.sequence:
                    if not isinstance(value, (list, tuple)):
                        raise TypeError(
                            f"{self.qualname}: {name} must be a sequence of arrays; got {type(value).__name__}."
                        )
                    operands.extend(value)
                    labels.extend(f"{name}[{i}]" for i in range(len(value)))
                else:
                    operands.append(value)
                    labels.append(name)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                params.update(value)
            else:
                params[name] = value
        for name, value in params.items():  # a masked array where jnp takes a plain one (repeats, shift)
            if (
                is_operand(value)
                and name not in self.spec.optional_operands
                and (self.spec.name, name) not in _MASKED_PARAMETERS
            ):
                params[name] = fully_valid_data(
                    value,
                    f"{self.qualname}: {name}=",
                    "it is a parameter, not data, and a masked entry has no value to use.",
                )
        for name, check in _validate.BY_NAME.items():  # arguments validated by kind, as jnp does or better
            if name in params:
                params[name] = check(params[name], f"{self.qualname}: {name}")
        where = params.pop("where", None) if self.spec.family in _WHERE_FAMILIES else None
        self._check_supported(params)
        if (
            operands
            and _empty_reduction(operands[0], params)
            and identity_over_empty(self.spec.name, params, len(operands[0].shape))
        ):
            # a reduction over a zero-size slice, where it has an identity: jnp's result, valid (a
            # sum 0, prod 1, any False, all True, logsumexp -inf, a norm 0); one with none (a mean:
            # 0 / 0) is masked by its rule. A sparse layout stores nothing to read then, so it is
            # made dense without a storage fallback
            operands = [o.todense() if isinstance(o, SparseMasked) and o.size == 0 else o for o in operands]
            out = self.dense(operands, params, where, labels)
            return from_pair(out.data, None) if isinstance(out, MaskedArray) else out  # (a count is plain)
        if (
            where is None
            and not any(params.get(n) is not None for n in self.spec.optional_operands)
            and any(isinstance(o, SparseMasked) for o in operands)
        ):
            return dispatch.apply(self.spec, operands, params, self.dense)
        return self.dense(operands, params, where, labels)

    def _check_supported(self, params):
        for name in list(params):
            if self.accepted is None or name in self.accepted:
                continue
            default = self.signature.parameters[name].default
            value = params.pop(name)
            if not (value is default or (isinstance(value, (bool, int, float, str)) and value == default)):
                raise TypeError(
                    f"{self.qualname}: {name}={value!r} is not supported with masked semantics "
                    f"(only its default, {name}={default!r})."
                )

    def dense(self, operands, params, where=None, labels=None):
        operands = dispatch.densify(operands, self.spec.name)
        labels = labels or [f"operand {i}" for i in range(len(operands))]
        pairs = [unwrap(o, f"{self.qualname}: {label}") for label, o in zip(labels, operands)]
        if where is not None:
            w = _as_mask(where, self.qualname)
            x = pairs[0]
            pairs[0] = Pair(
                x.data, and_masks(jnp.broadcast_to(True if x.mask is None else x.mask, jnp.shape(x.data)), w)
            )
        for name in self.spec.optional_operands:
            if params.get(name) is not None:
                (value,) = dispatch.densify([params[name]], self.spec.name)
                params[name] = unwrap(value, f"{self.qualname}: {name}")
        if self.spec.sequence:
            return wrap(self.spec.rule(pairs, **params))
        return wrap(self.spec.rule(*pairs, **params))


def _empty_reduction(x, params) -> bool:
    shape = getattr(x, "shape", None)
    if shape is None or 0 not in tuple(shape):
        return False
    return empty_slices(tuple(shape), normalize_axis(params.get("axis"), len(shape)))


def public_function(spec: OpSpec, module: str):
    """The public function of ``spec`` in ``module`` (``"numpy"`` or ``"nn"``)."""
    qualname = f"{_MODULE_NAMES.get(module, module)}.{spec.name}"
    call = _Call(spec, qualname)

    def fn(*args, **kwargs):
        return call(*args, **kwargs)

    fn.__name__ = spec.name
    fn.__qualname__ = spec.name
    fn.__module__ = _MODULE_NAMES.get(module, module)
    fn.__doc__ = docstring(spec, _MODULE_NAMES.get(module, module))
    fn.__signature__ = public_signature(spec)
    fn.__dict__["spec"] = spec  # the registry entry behind a public function
    return fn


def _method(spec: OpSpec, name: str, fn):
    base = "__" + name[3:] if name.startswith("__r") else None
    vararg = name in _VARARG_METHODS

    def unary(self):
        return fn(self)

    def reflected(self, other):
        return fn(other, self) if is_operand(other) else NotImplemented

    def binary(self, other):
        return fn(self, other) if is_operand(other) else NotImplemented

    def method(self, *args, **kwargs):
        if vararg and len(args) > 1:
            args = (args,)
        return fn(self, *args, **kwargs)

    if name in _UNARY_DUNDERS:
        method = unary
    elif base is not None and base in spec.methods:
        method = reflected
    elif name.startswith("__") and name != "__getitem__":
        method = binary
    else:
        method.__doc__ = fn.__doc__
        method.__dict__["__signature__"] = _method_signature(inspect.signature(fn))
    method.__name__ = method.__qualname__ = name
    return method


def _method_signature(sig):
    first, *rest = sig.parameters.values()
    return sig.replace(parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)] + rest)


def _install(spec: OpSpec, removed: bool = False):
    for module, namespace in _NAMESPACES.items():
        if namespace.get(spec.name) is not None and getattr(namespace[spec.name], "spec", None) is not None:
            if removed or module not in spec.modules:
                del namespace[spec.name]
                if spec.name in namespace.get("__all__", []):
                    namespace["__all__"].remove(spec.name)
    for name in [n for n, m in vars(ArrayMethods).items() if getattr(m, "op_name", None) == spec.name]:
        delattr(ArrayMethods, name)
    if removed:
        return
    fn = public_function(spec, spec.modules[0] if spec.modules else "masked_jax.ops")
    for module in spec.modules:
        namespace = _NAMESPACES.get(module)
        if namespace is not None:
            namespace[spec.name] = fn if module == spec.modules[0] else public_function(spec, module)
            if spec.name not in namespace.setdefault("__all__", []):
                namespace["__all__"].append(spec.name)
    for name in spec.methods:
        method = _method(spec, name, fn)
        method.__dict__["op_name"] = spec.name
        setattr(ArrayMethods, name, method)


def attach(module: str, namespace: dict) -> None:
    """Make ``namespace`` (a module's globals) receive the registry's ``module`` functions, now and
    for every later registration."""
    _NAMESPACES[module] = namespace
    namespace.setdefault("__all__", [])
    for spec in ops.REGISTRY.values():
        if module in spec.modules:
            _install(spec)


def function(name: str) -> Callable[..., Any]:
    """The public function of registered op ``name`` (also for ops with no public module)."""
    spec = ops.REGISTRY[name]
    for module in spec.modules:
        if module in _NAMESPACES:
            return _NAMESPACES[module][name]
    return public_function(spec, spec.modules[0] if spec.modules else "masked_jax.ops")


on_register(_install)
