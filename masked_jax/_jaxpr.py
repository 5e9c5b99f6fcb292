"""The one toolkit for reading and evaluating jaxprs, shared by every pass that walks one.

``maskify``'s interpreter, the row-read pass of ``row_sparse`` gradients, the Jacobian checker,
the optimizers' entrywise test and the fused kernel's tracer all evaluate or inspect a jaxpr
equation by equation. What they share lives here: how a variable is read (a literal is its own
value), how one equation is bound as ``jax.core.eval_jaxpr`` binds it, which primitives are calls
and where they keep their body, every equation of nested jaxprs, and a flat re-trace with calls
inlined.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> from masked_jax import _jaxpr
    >>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2.0)(1.0)
    >>> [e.primitive.name for e in _jaxpr.equations(closed.jaxpr)]
    ['jit', 'sin', 'mul']
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
from jax.extend import core as jcore

# checkpoint's primitive: exported as remat_p by newer jax; otherwise read off a staged checkpoint
REMAT_P = getattr(P, "remat_p", None) or jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).eqns[0].primitive
# call-like primitives, whose body runs once on their operands
CALL_PRIMITIVES = frozenset((P.jit_p, P.closed_call_p, P.call_p, P.custom_jvp_call_p, P.custom_vjp_call_p, REMAT_P))
# the same by name, for passes that see the primitives of other jax versions (pjit, core_call, ...)
CALL_NAMES = frozenset(
    "pjit jit closed_call core_call custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr checkpoint remat".split()
) | {p.name for p in CALL_PRIMITIVES}
# where a call keeps its body, in the order they are looked for
BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def is_literal(v: Any) -> bool:
    """Is jaxpr atom ``v`` a literal (a constant written into the equation; unhashable)?"""
    return isinstance(v, jcore.Literal)


def read(env: dict, v: Any) -> Any:
    """The value of jaxpr atom ``v`` in ``env``: a literal's own value, else ``env[v]``."""
    return v.val if isinstance(v, jcore.Literal) else env[v]


def bind(eqn: Any, invals: Sequence[Any]) -> list:
    """The outputs of equation ``eqn`` on ``invals``, as a list, bound as ``jax.core.eval_jaxpr``
    binds it (older jax versions hand a call's sub-functions out of ``get_bind_params``)."""
    return bind_primitive(eqn.primitive, eqn.params, invals)


def bind_primitive(prim: Any, params: Any, invals: Sequence[Any]) -> list:
    """The outputs of primitive ``prim`` with an equation's ``params`` on ``invals``, as
    :func:`bind` binds an equation."""
    params = prim.get_bind_params(params)
    if isinstance(params, tuple):
        subfuns, params = params
        outs = prim.bind(*subfuns, *invals, **params)
    else:
        outs = prim.bind(*invals, **params)
    return list(outs) if prim.multiple_results else [outs]


def call_body(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """``(jaxpr, consts)`` of a call-like equation's body (jit, closed_call, custom_jvp/vjp calls,
    checkpoint); ``None`` for any other equation."""
    if eqn.primitive not in CALL_PRIMITIVES and eqn.primitive.name not in CALL_NAMES:
        return None
    body = next((eqn.params[k] for k in BODY_PARAMS if k in eqn.params), None)
    if body is None:
        return None
    if isinstance(body, jcore.ClosedJaxpr):
        return body.jaxpr, body.consts
    return body, ()


def nested_jaxprs(values: Any) -> Iterator[Any]:
    """The jaxprs among an equation's parameter values (a ``cond``'s branches are a tuple of them)."""
    for v in values:
        if isinstance(v, jcore.ClosedJaxpr):
            yield v.jaxpr
        elif isinstance(v, jcore.Jaxpr):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from nested_jaxprs(v)


def equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and, after each, those of the jaxprs in its parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in nested_jaxprs(eqn.params.values()):
            yield from equations(sub)


def inline(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], bind_fn=bind) -> list:
    """Evaluate ``jaxpr`` by binding its primitives with ``bind_fn``, call-like primitives (nested
    jits, custom derivatives, checkpoints) inlined and copies dropped: traced, a flat program of
    the primitives that compute the values (for lowerings that know no calls or copies)."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(env, v) for v in eqn.invars]
        body = call_body(eqn)
        if body is not None:
            outs = inline(body[0], body[1], ins, bind_fn)
        elif eqn.primitive.name in ("copy", "copy_p"):
            outs = ins
        else:
            outs = bind_fn(eqn, ins)
        env.update(zip(eqn.outvars, outs))
    return [read(env, v) for v in jaxpr.outvars]
