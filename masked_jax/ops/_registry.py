"""The op registry: every masked op is declared once, as an :class:`OpSpec`.

A spec holds what defines the op: its name and family, its rule on
:class:`~masked_jax.ops._base.Pair` values, its public signature (``jax.numpy``'s parameter
names, defaults and keyword-only markers), the value that sanitises masked-out inputs, the
lax primitives it answers to inside :func:`masked_jax.maskify`, its segment kernel for
BCOO-backed arrays, and the checks of the conformance harness it is left out of (with the
reason). Everything else is derived from the registry when a spec is registered:

* the ``masked_jax.numpy`` / ``masked_jax.nn`` functions (``_frontend``),
* the ``MaskedArray`` methods and operators (``_frontend``),
* ``maskify``'s rules, keyed by primitive object (``ops.primitives``),
* the sparse layouts' rules (``layouts.dispatch`` reads ``family`` and ``segment``),
* the test tables (the conformance harness iterates over :data:`REGISTRY`).

Adding an op is one :func:`register` call (see ``docs/adding_ops.md``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

FAMILIES = ("elementwise", "binary", "reductions", "normalization", "shape", "linalg")

# The checks of the conformance harness; a spec leaves one out with a reason (``excluded``).
CHECKS = ("reference", "oracle", "transforms", "jacobians", "poison", "layouts", "compact", "maskify")

# Parameters a masked op accepts with their jnp meaning only at the default value.
_UNSUPPORTED_DEFAULTS = {"out": None}

# Ops with no public function (``modules=()``) are reached through ``maskify`` only, which turns
# sparse layouts into dense storage first: there is no layout path to check.
MASKIFY_ONLY = {"layouts": "reached only through maskify, which densifies sparse layouts first"}

# Annotations of the public signatures, by parameter name (operands are typed by ``operands``).
OPERAND = "ArrayLike | MaskedArray"
ANNOTATIONS = {
    "axis": "Axis",
    "keepdims": "bool",
    "dtype": "DTypeLike | None",
    "ddof": "int",
    "ord": "int | float | str | None",
    "q": "ArrayLike",
    "method": "str",
    "weights": f"{OPERAND} | None",
    "where": "ArrayLike | None",
    "out": "None",
    "decimals": "int",
    "shape": "Shape",
    "newshape": "Shape",
    "axes": "Any",
    "indices": "ArrayLike",
    "mode": "str | None",
    "precision": "Any",
    "preferred_element_type": "DTypeLike | None",
    "eps": "float",
}


@dataclasses.dataclass(frozen=True, eq=False)
class OpSpec:
    """One masked op.

    Attributes:
        name: public name (``masked_jax.numpy.<name>`` and/or ``masked_jax.nn.<name>``).
        family: one of :data:`FAMILIES`; decides the docs, the sparse-layout rule and the
            default maskify adapter.
        rule: ``rule(*operand_pairs, **params) -> Pair`` (or a list of Pairs, or a plain array
            for ``returns="array"``).
        signature: the public signature; operands are the parameters named in ``operands``.
        operands: names of the parameters that are (masked) arrays. A name starting with ``*``
            is variadic; ``sequence`` marks one parameter holding a list of arrays.
        optional_operands: parameters that may be arrays or ``None`` (``weights``, clip bounds).
        sequence: the operand parameter is a list of arrays (``concatenate``, ``stack``).
        modules: where the function is public: ``"numpy"``, ``"nn"`` or none (maskify only).
        methods: ``MaskedArray`` methods and operators bound to the op (``"sum"``, ``"__add__"``;
            ``"__radd__"`` swaps the operands).
        primitives: lax primitives the op answers to in ``maskify``: primitive objects (the
            family's adapter is used) or ``(primitive, adapter)`` pairs.
        segment: BCOO segment kernel ``fn(segments, values, **params)`` (reductions and
            normalizations along axes in O(stored entries)).
        safe: the value masked-out inputs are replaced with before a nonlinear ``fn``.
        fn: the jax function the rule applies to sanitised data (elementwise and binary ops).
        returns: ``"masked"`` or ``"array"`` (``count``, ``argsort``: always defined).
        example: ``(setup, call, result)`` doctest lines, ``{mod}``/``{name}`` substituted.
        excluded: harness check -> why this op is left out of it.
        refused_dtypes: dtype name -> why the op refuses a dtype that ``jax.numpy`` accepts (the
            jnp-oracle check of the harness skips exactly these).
        jax_name: the mirrored jax function, for the docstring.
        static: ``static(body, *operand_shapes) -> iterable of keyword dicts``: the static
            arguments ``fn`` may have been called with (``body``, the jaxpr of the call, may narrow
            them down; each candidate is still checked by re-tracing). Given, ``maskify`` recognises ``fn``'s own named
            ``jit`` call inside a traced function (by re-tracing ``fn`` with each candidate and
            comparing the programs) and applies this op's rule to the whole call instead of
            interpreting its body, which is written for dense arrays (order statistics: jnp's
            median sorts, then gathers at positions computed from the static length).
    """

    name: str
    family: str
    rule: Callable[..., Any]
    signature: inspect.Signature
    operands: tuple[str, ...] = ("x",)
    optional_operands: tuple[str, ...] = ()
    sequence: bool = False
    modules: tuple[str, ...] = ("numpy",)
    methods: tuple[str, ...] = ()
    primitives: tuple = ()
    segment: Callable[..., Any] | None = None
    safe: Any = None
    fn: Callable[..., Any] | None = None
    returns: str = "masked"
    example: tuple[str, str, str] | None = None
    excluded: Mapping[str, str] = dataclasses.field(default_factory=dict)
    jax_name: str = ""
    summary: str = ""
    static: Callable[..., Any] | None = None
    refused_dtypes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}; got {self.family!r}.")
        unknown = set(self.excluded) - set(CHECKS)
        if unknown:
            raise ValueError(f"excluded names unknown checks {sorted(unknown)}; checks are {CHECKS}.")
        params = self.signature.parameters
        for name in self.operands + self.optional_operands:
            if name.lstrip("*") not in params:
                raise ValueError(f"op {self.name!r}: operand {name!r} is not a parameter of {self.signature}.")
        object.__setattr__(self, "excluded", MappingProxyType(dict(self.excluded)))

    @property
    def unsupported(self) -> dict[str, Any]:
        """Parameters accepted only at their default (``out``)."""
        return {k: v for k, v in _UNSUPPORTED_DEFAULTS.items() if k in self.signature.parameters}

    def __repr__(self):
        return f"OpSpec({self.name!r}, family={self.family!r})"


REGISTRY: dict[str, OpSpec] = {}
_LISTENERS: list[Callable[..., None]] = []  # listener(spec, removed=False)


def register(spec: OpSpec) -> OpSpec:
    """Add ``spec`` to the registry and install it everywhere it is derived into.

    Registering a name twice replaces the op (the latest definition wins everywhere).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> from masked_jax.ops import _registry, elementwise
        >>> spec = _registry.register(elementwise.unary_spec("cube", lambda x: x ** 3, safe=0))
        >>> x = mj.masked_array(jnp.array([2.0, 9.0]), jnp.array([True, False]))
        >>> mj.numpy.cube(x)
        MaskedArray([8.0 --], dtype=float32)
        >>> _registry.unregister("cube")
    """
    if not isinstance(spec, OpSpec):
        raise TypeError(f"spec must be an OpSpec; got {type(spec).__name__}.")
    REGISTRY[spec.name] = spec
    for listener in _LISTENERS:
        listener(spec)
    return spec


def unregister(name: str) -> None:
    """Remove op ``name`` from the registry and from everything derived from it."""
    spec = REGISTRY.pop(name)
    for listener in _LISTENERS:
        listener(dataclasses.replace(spec, modules=(), methods=(), primitives=(), static=None), removed=True)


def on_register(listener: Callable[..., None]) -> None:
    """Call ``listener(spec)`` for every registered spec now and for every later registration."""
    _LISTENERS.append(listener)
    for spec in list(REGISTRY.values()):
        listener(spec)


def signature_of(fn: Callable[..., Any], *, drop: tuple[str, ...] = ()) -> inspect.Signature:
    """The signature of ``fn`` without private and ``drop``-ped parameters, annotations removed
    (they are set from :data:`ANNOTATIONS` when the public function is built)."""
    sig = inspect.signature(fn)
    params = [
        p.replace(annotation=inspect.Parameter.empty)
        for p in sig.parameters.values()
        if not p.name.startswith("_") and p.name not in drop
    ]
    return sig.replace(parameters=params, return_annotation=inspect.Signature.empty)


def rule_signature(rule: Callable[..., Any]) -> inspect.Signature:
    """A hand-written rule's own signature (its operand parameters take Pairs)."""
    return signature_of(rule)


__all__ = [
    "ANNOTATIONS",
    "CHECKS",
    "FAMILIES",
    "MASKIFY_ONLY",
    "OPERAND",
    "OpSpec",
    "REGISTRY",
    "on_register",
    "register",
    "rule_signature",
    "signature_of",
    "unregister",
]
