"""Inputs and outputs of a Jacobian check, reduced to flat vectors.

Every differentiable input leaf (a float array, ``MaskedArray``, BCOO-backed masked array,
``jax.experimental.sparse.BCOO`` or row-sparse array) becomes a :class:`Leaf`: a static
description (kind, shape, dtype, the pattern of *specified* elements) plus a flat vector of
values over all its elements. :meth:`Leaf.build` turns a value vector back into an object of
the original kind, optionally specifying more elements than the original (a dense-semantics
perturbation of an unspecified element makes it specified). Output leaves become a filled
vector (unspecified read as 0), the raw data and a validity mask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse as jsparse

from masked_jax._core import MaskedArray, SparseMasked
from masked_jax.layouts import BCOOMaskedArray, RowSparseArray, rows_from_parts

ALL = "all"  # ``extra`` value: every element specified
PADDED = "padded"  # ``extra`` value: the pattern plus one padding slot (sparse kinds; see ``Leaf.build``)
SPARSE_KINDS = ("bcoo", "bcoo_masked", "row_sparse")


def is_leaf(x) -> bool:
    return isinstance(x, (MaskedArray, SparseMasked, jsparse.BCOO))


def random_draws(seed, sizes, out_size, fast):
    """Every random number one check uses, drawn on the host from ``seed`` (uniform, float32): the
    two random fills under the masks (``"fill"`` in [0.5, 1.5), ``"alt"`` in [-2, -1)), the leak
    probes' tangent and cotangent and, with ``fast``, the projections' directions: ``"u"``
    (``N_DIRECTIONS`` x every input's elements) and ``"v"`` (per input, ``N_DIRECTIONS`` x
    outputs), all in [-1, 1). Operands of the check's program, not computed in it: a random draw
    compiled into the program is fused into every consumer of a slice of it, which compiled to
    most of a check. Any continuous distribution makes ``v^T E u = 0`` for a wrong Jacobian
    (``E != 0``) an event of probability 0.

    >>> sorted(random_draws(0, (3, 2), 4, fast=False))
    ['alt', 'cotangent', 'fill', 'tangent']
    """
    return _draws(int(seed), tuple(int(s) for s in sizes), int(out_size), bool(fast))


@functools.lru_cache(maxsize=32)
def _draws(seed, sizes, out_size, fast):
    rng = np.random.default_rng(seed)
    total = sum(sizes)
    # (a transfer: ``jnp.asarray`` would compile a program for each new shape)
    uniform = lambda shape, lo=-1.0, hi=1.0: jax.device_put(rng.uniform(lo, hi, shape).astype(np.float32))  # noqa: E731
    draws = {
        "fill": uniform(total, 0.5, 1.5),
        "alt": uniform(total, -2.0, -1.0),
        "tangent": uniform(total),
        "cotangent": uniform(out_size),
    }
    if fast:
        draws["u"] = uniform((N_DIRECTIONS, total))
        draws["v"] = uniform((len(sizes), N_DIRECTIONS, out_size))
    return draws


def with_extra(spec, extra):
    """The mask of a ``MaskedArray`` input with pattern ``spec`` (flat) and ``extra`` (see
    :meth:`Leaf.build`; also a bool array of ``spec``'s size: those elements specified too, so that
    a batch of evaluations can take the input at different patterns)."""
    if extra is ALL:
        return jnp.ones_like(spec)
    if extra is None or extra is PADDED or spec.size == 0:  # an empty input has no entry to set
        return spec
    if getattr(extra, "dtype", None) == jnp.bool_:
        return spec | extra
    return spec.at[extra].set(True, mode="drop")


@dataclasses.dataclass(frozen=True)
class Leaf:
    """Static description of one differentiable input (hashable: part of the compile cache key)."""

    name: str
    kind: str  # "array" | "masked" | "bcoo" | "bcoo_masked" | "row_sparse"
    shape: tuple
    dtype: str
    spec_bytes: bytes  # packed bool pattern of specified elements

    @functools.cached_property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @functools.cached_property
    def spec(self) -> np.ndarray:
        """The pattern (read-only: computed once per leaf)."""
        spec = np.unpackbits(np.frombuffer(self.spec_bytes, np.uint8), count=self.size).astype(bool)
        spec.flags.writeable = False
        return spec

    def build(self, values, extra=None, pattern=None):
        """An object of this leaf's kind holding ``values`` (flat, all elements).

        ``extra``: ``None`` (the original pattern), an int element index that becomes specified
        too (out of range: none), :data:`ALL` (every element specified), or :data:`PADDED`: the
        original pattern plus one padding slot (a BCOO entry at the out-of-range index, a row
        ``N`` of a row-sparse array) whose data is the first unspecified element's value, so that
        a leak probe puts its NaN or inf into the padding as well as under the masks. For dense
        kinds, and when every element is specified, ``PADDED`` is the original pattern.
        """
        if extra is PADDED and (self.kind not in SPARSE_KINDS or self.spec.all()):
            extra = None
        values = values.astype(self.dtype)
        if self.kind == "array":
            return values.reshape(self.shape)
        spec = jnp.asarray(self.spec) if pattern is None or self.kind != "masked" else pattern
        if self.kind == "masked":
            mask = with_extra(spec, extra)
            # plain unflatten, no tangent masking: what the function does with masked data is tested
            return MaskedArray.tree_unflatten(None, (values.reshape(self.shape), mask.reshape(self.shape)))
        if self.kind == "row_sparse":
            return self._rows(values, extra)
        return self._bcoo(values, extra)

    def _bcoo(self, values, extra):
        filler = 0  # the element whose value padding slots hold
        if extra is ALL:
            lin = jnp.arange(self.size)
        elif extra is PADDED:
            lin = jnp.asarray(np.append(np.flatnonzero(self.spec), self.size))
            filler = int(np.flatnonzero(~self.spec)[0])
        else:
            lin = jnp.asarray(np.flatnonzero(self.spec))
            if extra is not None:  # one more entry, or padding if the element is already stored
                new = (extra < self.size) & ~jnp.asarray(self.spec)[jnp.clip(extra, 0, self.size - 1)]
                lin = jnp.concatenate([lin, jnp.where(new, extra, self.size)[None]])
        inside = lin < self.size
        safe = jnp.where(inside, lin, filler)
        coords = jnp.stack(jnp.unravel_index(safe, self.shape), -1) if self.shape else jnp.zeros((lin.size, 0), int)
        indices = jnp.where(inside[:, None], coords, jnp.array(self.shape, int)).astype(jnp.int32)
        b = jsparse.BCOO((values[safe], indices), shape=self.shape)
        return BCOOMaskedArray.from_bcoo(b) if self.kind == "bcoo_masked" else b

    def _rows(self, values, extra):
        n = self.shape[0]
        row_size = self.size // max(n, 1)
        block = values.reshape((n, row_size))
        stored = self.spec.reshape(n, row_size).any(1)
        filler = 0  # the row whose values padding rows hold
        if extra is ALL:
            rows = jnp.arange(n)
        elif extra is PADDED:
            rows = jnp.asarray(np.append(np.flatnonzero(stored), n))
            filler = int(np.flatnonzero(~stored)[0])
        else:
            rows = jnp.asarray(np.flatnonzero(stored))
            if extra is not None:
                r = jnp.asarray(extra) // max(row_size, 1)
                new = (r < n) & ~jnp.asarray(stored)[jnp.clip(r, 0, max(n - 1, 0))]
                rows = jnp.concatenate([rows, jnp.where(new, r, n)[None]])
        data = block[jnp.where(rows < n, rows, filler)].reshape((rows.shape[0],) + self.shape[1:])
        return rows_from_parts(self.shape, data, rows.astype(jnp.int32))


def describe(name: str, x, dtype):
    """``(leaf, values)`` for a differentiable input (``None`` for integer / bool ones).

    ``values``: every element (the check sets the unspecified ones to 0 for the dense-semantics
    point inside its compiled program: no eager select per call).
    """
    if isinstance(x, MaskedArray):
        # the pattern on the host (broadcasting the compact mask eagerly would compile a program)
        compact = x.compact_mask
        spec = np.ones(x.shape, bool) if compact is None else np.broadcast_to(np.asarray(compact), x.shape)
        kind, values = "masked", x.data
    elif isinstance(x, RowSparseArray):
        dense = x.coalesce().todense()
        kind, values, spec = "row_sparse", dense.filled(0), dense.mask
    elif isinstance(x, (BCOOMaskedArray, jsparse.BCOO)):
        dense = (x if isinstance(x, BCOOMaskedArray) else BCOOMaskedArray.from_bcoo(x)).todense()
        kind = "bcoo_masked" if isinstance(x, BCOOMaskedArray) else "bcoo"
        values, spec = dense.filled(0), dense.mask
    elif isinstance(x, (jax.Array, np.ndarray, float, int)) and not isinstance(x, bool):
        values = jnp.asarray(x)
        kind, spec = "array", np.ones(values.shape, bool)
    else:
        raise TypeError(
            f"check_jacobian: input {name} is a {type(x).__name__}; expected arrays, "
            "MaskedArrays, BCOO-backed or row-sparse arrays, or jax BCOOs."
        )
    if jnp.issubdtype(values.dtype, jnp.complexfloating):
        raise TypeError(
            f"check_jacobian: input {name} is complex ({values.dtype}); complex inputs are "
            "not supported: pass the real and imaginary parts as separate inputs."
        )
    if not jnp.issubdtype(values.dtype, jnp.floating):
        return None  # integer / bool: a constant, as torch's gradcheck ignores such inputs
    spec = np.asarray(spec).ravel()
    if dtype is None and np.dtype(values.dtype).itemsize < 4:
        # float16 / bfloat16: a central difference there cannot resolve a derivative (bfloat16's
        # rounding alone moves it by ~0.3 at outputs near 1), so the check runs in float32
        dtype = "float32"
    leaf = Leaf(name, kind, tuple(values.shape), np.dtype(dtype or values.dtype).name, np.packbits(spec).tobytes())
    return leaf, values  # cast and flattened inside the compiled check


def output_vectors(out, names_only: bool = False) -> Any:
    """Flatten ``f``'s output: ``(names, filled, raw, mask)``; the vectors are concatenated over the
    differentiable output leaves (float dtypes), others are listed in ``skipped``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_leaf)
    names, filled, raw, mask, sizes, skipped = [], [], [], [], [], []
    for path, leaf in flat:
        name = "out" + jax.tree_util.keystr(path)
        if isinstance(leaf, MaskedArray):
            d, m = leaf.data, leaf.mask
        elif isinstance(leaf, SparseMasked):
            dense = leaf.todense()
            d, m = dense.data, dense.mask
        elif isinstance(leaf, jsparse.BCOO):
            d = leaf.todense()
            m = jnp.ones(d.shape, bool)
        elif isinstance(leaf, (jax.Array, np.ndarray, float, int)) and not isinstance(leaf, bool):
            d = jnp.asarray(leaf)
            m = jnp.ones(d.shape, bool)
        else:
            raise TypeError(
                f"check_jacobian: output {name} is a {type(leaf).__name__}; the function must "
                "return arrays, MaskedArrays or sparse arrays (in any pytree)."
            )
        if not jnp.issubdtype(d.dtype, jnp.floating):
            skipped.append(f"{name} ({d.dtype}: not differentiable)")
            continue
        m = jnp.broadcast_to(m, d.shape)
        names.append((name, tuple(d.shape)))
        filled.append(jnp.where(m, d, 0).ravel())
        raw.append(d.ravel())
        mask.append(m.ravel())
        sizes.append(d.size)
    if names_only:
        return names, skipped
    cat = lambda xs, dt: jnp.concatenate(xs) if xs else jnp.zeros(0, dt)  # noqa: E731
    return cat(filled, float), cat(raw, float), cat(mask, bool)


# the checker's settings
SEMANTICS = ("dense", "masked")

MODES = ("fwd", "rev")

# fast=None: full Jacobian tables up to this many input elements in all. They check every entry
# and locate a failure (the leak map), and below a few thousand elements they cost about what
# the projections cost (a 2-layer flax MLP on 2 CPU cores, first check with the model's
# building: full tables 2.5 s at 163 elements, projections 2.3 s); past that the tables grow
# with the square of the size and the projections do not.
FULL_MAX_ELEMENTS = 2048

N_DIRECTIONS = 4  # random directions per input in fast mode

NEAR_MISS = 100.0  # a mismatch within this many tolerances is re-checked with the finite differences' error
