"""Catch-up for lazy updates: a row touched after ``k`` untouched steps is first brought to what
the dense optimizer would hold after ``k`` zero-gradient steps.

A lazy (row-sparse) optimizer leaves an untouched row's state alone, where the dense optimizer
would decay it every step: momentum and Adam's moments by ``b1``, ``b2`` per step, the parameter
by decoupled weight decay, and the parameter would also drift with the decaying momentum. With
per-row counters of the step each row was last current at, the catch-up applies ``k`` steps of
that at once, in closed form, when the row is touched again.

The closed forms are read off the inner transformation itself, at trace time, by running its
``update`` on a one-row probe with a zero gradient (concrete values, no cost per step):

* each parameter-shaped state leaf ``s`` must decay linearly and on its own, ``s -> c * s``
  (``c``: ``b1`` for Adam's ``mu``, ``b2`` for ``nu``, the momentum for a trace, 1 for Adagrad's
  sums); after ``k`` steps ``s * c**k``;
* the parameter at zero state must move linearly, ``p -> r * p`` (``r = 1 - lr * weight_decay``
  for decoupled weight decay); after ``k`` steps ``p * r**k``;
* if the zero-gradient update is also linear in the state (``u = (r - 1) p + sum_l a_l s_l``, as
  for SGD with momentum or Nesterov), the drift ``sum_l a_l s_l (r**k - c_l**k) / (r - c_l)`` is
  added to the parameter too, and the catch-up is exact. Adam's update ``m / (sqrt(v) + eps)`` is
  not linear in its state: its drift on untouched rows is left out (the catch-up of its moments
  and of decoupled weight decay stays exact).

Transformations whose zero-gradient step is not of this form (L2 weight decay added to the
gradient before a momentum, a state floored away from zero as adamax's, gradient noise, clipping
by the parameter) are rejected with a
``ValueError`` when the first update is traced. The hyperparameters are read at step 0: with a
learning-rate or weight-decay schedule, the catch-up uses their initial values.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax.ops._base import accumulation_dtype
from masked_jax.optim._state import _map_param_shaped, _Reference

_RTOL = 1e-5


class LazyCatchUpState(NamedTuple):
    """``lazy(inner, catch_up=True)``'s state: ``inner``'s, the number of updates done, and per
    parameter leaf the update count at which each row (leading axis) was last brought current."""

    inner: Any
    step: jax.Array
    last: Any


def init_counters(params):
    """One int32 counter per row (per leading index) of every parameter leaf; 0-d leaves get one."""
    return jax.tree_util.tree_map(lambda p: jnp.zeros(np.shape(p)[:1], jnp.int32), params)


@dataclasses.dataclass(frozen=True)
class Coefficients:
    """Per parameter leaf ``i``: ``decay[l][i]`` of state subtree ``l``, ``keep[i]`` (``r``) and,
    when the zero-gradient update is linear in the state, ``drift[l][i]`` (``a``)."""

    decay: list
    keep: list
    drift: list | None


def _uniform(x, what):
    x = np.asarray(x, np.float64)
    value = float(x.reshape(-1)[0]) if x.size else 0.0
    if not np.allclose(x, value, rtol=_RTOL, atol=1e-30):
        raise ValueError(
            f"lazy(catch_up=True): the inner transformation's {what} differs between entries of one "
            "parameter at a zero gradient, so no per-row closed form exists."
        )
    return value


def probe(inner, grads_like) -> Coefficients:
    """Read the zero-gradient step of ``inner`` off a one-row probe (see the module docstring)."""
    leaves, treedef = jax.tree_util.tree_flatten(grads_like)
    with jax.ensure_compile_time_eval():
        # float16/bfloat16 probed in float32: their rounding makes two steps look non-linear
        shapes = [
            (tuple(np.shape(x)[:1] and (1,)) + tuple(np.shape(x)[1:]), accumulation_dtype(x.dtype)) for x in leaves
        ]
        zeros = treedef.unflatten([jnp.zeros(s, d) for s, d in shapes])
        ref = _Reference.of(zeros)
        base = inner.init(zeros)
        count = []
        _map_param_shaped(ref, lambda ls: count.append(1) or ls, base)
        n_sub = len(count)

        def run(state_values, p_value):
            which = iter(range(n_sub))
            state = _map_param_shaped(
                ref, lambda ls: (lambda v: [jnp.full_like(x, v) for x in ls])(state_values[next(which)]), base
            )
            params = treedef.unflatten([jnp.full(s, p_value, d) for s, d in shapes])
            updates, new = inner.update(zeros, state, params)
            subtrees = []
            _map_param_shaped(ref, lambda ls: subtrees.append([np.asarray(x) for x in ls]) or ls, new)
            return [np.asarray(u) for u in treedef.flatten_up_to(updates)], subtrees

        def close(a, b):
            return all(np.allclose(x, y, rtol=_RTOL, atol=1e-12) for x, y in zip(a, b))

        unit = [[1.0 if m == l else 0.0 for m in range(n_sub)] for l in range(n_sub)]
        decay = []
        for l in range(n_sub):
            _, one = run(unit[l], 0.0)
            _, two = run([2 * v for v in unit[l]], 0.0)
            for m in range(n_sub):
                if m != l and not all(np.allclose(x, 0) for x in one[m]):
                    raise ValueError(
                        "lazy(catch_up=True): one part of the inner transformation's state changes "
                        "another at a zero gradient; catch-up needs each state leaf to decay on its own."
                    )
            if not close([2 * x for x in one[l]], two[l]):
                raise ValueError(
                    "lazy(catch_up=True): the inner transformation's state does not decay linearly at a "
                    "zero gradient (s -> c * s); no closed form for k skipped steps."
                )
            decay.append([_uniform(x, "state decay") for x in one[l]])
        _, s0 = run([0.0] * n_sub, 0.0)
        if any(not np.allclose(x, 0, atol=1e-12) for sub in s0 for x in sub):
            raise ValueError(
                "lazy(catch_up=True): the inner transformation's state leaves zero at a zero gradient "
                "(it is floored or offset, as adamax's max(b2 * nu, eps) is); catch-up needs each state "
                "leaf to decay linearly, s -> c * s."
            )
        u1, s1 = run([0.0] * n_sub, 1.0)
        u2, _ = run([0.0] * n_sub, 2.0)
        if any(not np.allclose(x, 0, atol=1e-12) for sub in s1 for x in sub):
            raise ValueError(
                "lazy(catch_up=True): the inner transformation's state changes with the parameters at a "
                "zero gradient (L2 weight decay added to the gradient before a momentum or an Adam "
                "moment); use decoupled weight decay (optax.adamw, or add_decayed_weights after the "
                "moments) to catch up lazily."
            )
        if not close([2 * x for x in u1], u2):
            raise ValueError(
                "lazy(catch_up=True): the inner transformation moves the parameters non-linearly at a "
                "zero gradient; no closed form for k skipped steps."
            )
        keep = [1.0 + _uniform(x, "weight decay") for x in u1]
        drift = []
        for l in range(n_sub):
            ua, _ = run(unit[l], 0.0)
            ub, _ = run([2 * v for v in unit[l]], 0.0)
            drift.append(ua if close([2 * x for x in ua], ub) else None)
        both, _ = run([1.0] * n_sub, 1.0)
        linear = all(d is not None for d in drift) and close(
            both, [k - 1.0 + sum(drift[l][i] for l in range(n_sub)) for i, k in enumerate(keep)]
        )
        drift = [[_uniform(x, "drift") for x in d] for d in drift] if linear else None
    return Coefficients(decay, keep, drift)


def _power(base: float, k):
    return jnp.power(jnp.asarray(base, jnp.float32), k)


def _geometric(r: float, c: float, k):
    """``sum_{j=1..k} r**(k-j) c**(j-1)``."""
    if abs(r - c) > 1e-6:
        return (_power(r, k) - _power(c, k)) / (r - c)
    return k * _power(r, jnp.maximum(k - 1, 0))


def catch_up_rows(coeffs: Coefficients, i: int, k, params, subtrees):
    """Parameter rows and state rows (``subtrees[l]``) of leaf ``i`` brought ``k`` (per row) steps
    forward: ``(params or None, [subtree rows])``."""
    rows = k.astype(jnp.float32)

    def per_row(x):
        return x.reshape(x.shape + (1,) * (np.ndim(params if params is not None else subtrees[0]) - x.ndim))

    new_params = None
    if params is not None:
        total = per_row(_power(coeffs.keep[i], rows)).astype(params.dtype) * params
        if coeffs.drift is not None:
            for l, s in enumerate(subtrees):
                a = coeffs.drift[l][i]
                if a != 0.0:
                    total = total + (a * per_row(_geometric(coeffs.keep[i], coeffs.decay[l][i], rows))).astype(
                        params.dtype
                    ) * s.astype(params.dtype)
        new_params = total
    new_state = [per_row(_power(coeffs.decay[l][i], rows)).astype(s.dtype) * s for l, s in enumerate(subtrees)]
    return new_params, new_state


def needs_params(coeffs: Coefficients) -> bool:
    return any(r != 1.0 for r in coeffs.keep) or (
        coeffs.drift is not None and any(a != 0.0 for d in coeffs.drift for a in d)
    )


def rows_since(v, last, step):
    """Per row the gradient leaf's view touches: steps since the row was last current (0 for
    padding rows)."""
    return v.steps_since(last, step)


def touch(v, last, step):
    """The counters after this update: rows the view touches are current as of ``step + 1``."""
    return v.touch(last, step)
