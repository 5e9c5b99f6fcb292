"""One batch of evaluations of ``f``: rows over the vector of every input's elements end to end,
each with its own point, its own input patterns and its own tangent or cotangent, run as one
``vmap``. The check's points, finite differences, projections and leak probes add their rows to
the same batches, so that the compiled check holds one evaluation of ``f`` with its JVP and one
with its VJP however many points, directions, probes and inputs it takes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from masked_jax.checking._inputs import ALL, PADDED, SPARSE_KINDS

# a VJP row's cotangent ``v`` on the outputs, times the row's own output mask (``ON_VALID``) or its
# complement (``ON_MASKED``): a cotangent on the valid outputs where they are not known beforehand
PLAIN, ON_VALID, ON_MASKED = 0, 1, 2


def starts_of(sizes):
    """Where each input begins in the concatenation of inputs of ``sizes`` elements."""
    return [sum(sizes[:k]) for k in range(len(sizes))]


def split(x, starts, sizes, like):
    """The vector ``x`` of every input's elements end to end (its last axis), as the inputs, each in
    the dtype of its counterpart in ``like``."""
    return [x[..., a : a + size].astype(v.dtype) for a, size, v in zip(starts, sizes, like)]


def batch_dtype(arrays):
    """The dtype of the vector of every input's elements: the widest of ``arrays``'."""
    return jnp.result_type(*arrays)


def richardson_error(d1, d2):
    """The error of the central difference ``d1`` (step h), estimated from ``d2`` (step 2h):
    their truncation errors are c h^2 and 4 c h^2, so ``|d1 - d2| / 3`` (Richardson's estimate,
    as numdifftools and scipy.differentiate use), which also picks up their rounding noise."""
    return jnp.abs(d1 - d2) / 3


class Batch:
    """Rows of one ``vmap`` over ``f``: ``kind`` ``"eval"`` (the outputs), ``"jvp"`` (the outputs
    and a tangent of them) or ``"vjp"`` (the outputs and a cotangent of the inputs).

    ``outputs(inputs, extras)`` is ``f``'s flat ``(filled, raw, mask)`` at a list of inputs;
    ``extras`` (one per input, see :meth:`Leaf.build`) say which elements are specified on top of
    each input's pattern. Rows that all take the same extras keep them static; otherwise a
    ``MaskedArray`` input's extras become a bool operand per row (a sparse input's cannot: its
    structure changes with them, so its rows must agree).

    Example (inside a traced check)::

        batch = Batch(outputs, leaves, "jvp", out_size)
        h = batch.add(points, direction=tangents, raw=True)
        batch.run()
        (filled, raw, mask), tangents = batch[h]
    """

    def __init__(self, outputs, leaves, kind, out_size):
        self.outputs, self.leaves, self.kind, self.out_size = outputs, leaves, kind, out_size
        self.sizes = [leaf.size for leaf in leaves]
        self.starts = starts_of(self.sizes)
        self.parts: list = []
        self.results = None

    @property
    def rows(self) -> int:
        return sum(p["x"].shape[0] for p in self.parts)

    def add(self, x, extras=None, direction=None, raw=False, code=PLAIN):
        """Rows at the points ``x`` (rows x every input's elements); ``direction``: their tangents
        (``"jvp"``, like ``x``) or cotangents (``"vjp"``, rows x outputs; ``code`` multiplies them
        by each row's own output mask, :data:`ON_VALID`, or its complement), 0 where ``None``;
        ``raw``: per row (or for all), the derivative is of the raw outputs rather than the filled
        ones. Returns the handle that :meth:`__getitem__` takes."""
        if self.results is not None:
            raise RuntimeError("Batch.add: the batch has already run")
        if direction is not None and self.kind == "eval":
            raise ValueError("Batch.add: an evaluation batch takes no tangent or cotangent")
        r = x.shape[0]
        extras = [
            None if leaf.kind == "array" or (e is PADDED and leaf.kind not in SPARSE_KINDS) else e
            for leaf, e in zip(self.leaves, extras or [None] * len(self.leaves))
        ]
        start = self.rows
        self.parts.append(
            {
                "x": x,
                "extras": extras,
                "direction": direction,
                "raw": jnp.broadcast_to(jnp.asarray(raw), (r,)),
                "code": jnp.broadcast_to(jnp.asarray(code, jnp.int8), (r,)),
            }
        )
        return start, start + r

    def _extras(self):
        """``(static, batched)``: the extras every row shares (``batched`` ``None``), or per input
        ``None`` (none for any row) and a bool operand per row."""
        first = self.parts[0]["extras"]
        if all(all(e is g for e, g in zip(p["extras"], first)) for p in self.parts):
            if not any(hasattr(e, "shape") for e in first):
                return first, None
        batched = []
        for i, leaf in enumerate(self.leaves):
            column = [p["extras"][i] for p in self.parts]
            if all(e is None for e in column):
                batched.append(None)
                continue
            if leaf.kind != "masked":
                raise ValueError(f"Batch: rows of a {leaf.kind} input must take the same extras")
            batched.append(
                jnp.concatenate(
                    [
                        e
                        if hasattr(e, "shape")
                        else jnp.full((p["x"].shape[0], self.sizes[i]), e is ALL)  # None: nothing on top
                        for e, p in zip(column, self.parts)
                    ]
                )
            )
        return None, batched

    def run(self):
        """Evaluate every row (one ``vmap``)."""
        if not self.parts:
            self.results = ()
            return
        x = jnp.concatenate([p["x"] for p in self.parts])
        static, batched = self._extras()
        raw = jnp.concatenate([p["raw"] for p in self.parts])
        code = jnp.concatenate([p["code"] for p in self.parts])
        width = x.shape[1] if self.kind == "jvp" else self.out_size
        direction = jnp.concatenate(
            [
                jnp.zeros((p["x"].shape[0], width), x.dtype)
                if p["direction"] is None
                else p["direction"].astype(x.dtype)
                for p in self.parts
            ]
        )
        starts, sizes, leaves = self.starts, self.sizes, self.leaves

        def triple(y, ex):  # ((filled, raw), mask): the mask aside, as auxiliary data
            o = self.outputs(split(y, starts, sizes, leaves), ex)
            return (o[0], o[1]), o[2]

        def one(y, ex, d, r, c):
            ex = static if batched is None else ex
            if self.kind == "eval":
                (filled, raw_out), mask = triple(y, ex)
                return (filled, raw_out, mask), jnp.zeros((0,), y.dtype)
            if self.kind == "jvp":
                (filled, raw_out), (t_filled, t_raw), mask = jax.jvp(lambda z: triple(z, ex), (y,), (d,), has_aux=True)
                return (filled, raw_out, mask), jnp.where(r, t_raw, t_filled)
            (filled, raw_out), pull, mask = jax.vjp(lambda z: triple(z, ex), y, has_aux=True)
            w = d * jnp.where(c == ON_VALID, mask, jnp.where(c == ON_MASKED, ~mask, True))
            cot = pull((jnp.where(r, 0, w).astype(filled.dtype), jnp.where(r, w, 0).astype(raw_out.dtype)))[0]
            return (filled, raw_out, mask), cot

        self.results = jax.vmap(one)(x, batched, direction, raw, code)

    def __getitem__(self, handle):
        """``((filled, raw, mask), derivatives)`` of the rows ``handle`` (from :meth:`add`)."""
        if self.results is None:
            raise RuntimeError("Batch: read before run()")
        a, b = handle
        return jax.tree_util.tree_map(lambda v: v[a:b], self.results)
