"""``lax.associative_scan`` while ``maskify`` traces: the call is recorded (its combining function
and arguments), so that the interpreter runs it as one masked scan instead of its unrolled levels.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
from jax import lax

# -- lax.associative_scan, recognised as a whole call -------------------------------------------------
# Its body (slices, pads, the combine function) read primitive by primitive would combine valid and
# masked elements into masked ones, masking everything after a hole or left padding. While maskify
# traces, lax.associative_scan is therefore wrapped in a jit named _SCAN_NAME + its index in this
# trace's record of (fn, elems structure, reverse, axis), and the interpreter runs the scan over
# valid elements only (``_Interpreter._associative_scan``).
_ASSOCIATIVE_SCAN = lax.associative_scan

_SCAN_NAME = "masked_jax_associative_scan_"

_SCAN_RECORDS = threading.local()  # per thread: a stack of the records of the traces in progress

_SCAN_PATCH = {"users": 0, "lock": threading.Lock()}


@functools.wraps(_ASSOCIATIVE_SCAN)
def _recorded_associative_scan(fn, elems, reverse=False, axis=0):
    stack = getattr(_SCAN_RECORDS, "stack", None)
    if not stack:  # another thread's trace patched it: jax's own scan
        return _ASSOCIATIVE_SCAN(fn, elems, reverse=reverse, axis=axis)
    record = stack[-1]
    leaves, tree = jax.tree_util.tree_flatten(elems)

    def scan(*leaves):
        return _ASSOCIATIVE_SCAN(fn, jax.tree_util.tree_unflatten(tree, leaves), reverse=reverse, axis=axis)

    scan.__name__ = scan.__qualname__ = f"{_SCAN_NAME}{len(record)}"
    record.append((fn, tree, reverse, axis))
    return jax.jit(scan)(*leaves)


@contextlib.contextmanager
def _recording_scans():
    stack = _SCAN_RECORDS.__dict__.setdefault("stack", [])
    stack.append([])
    with _SCAN_PATCH["lock"]:
        _SCAN_PATCH["users"] += 1
        lax.associative_scan = _recorded_associative_scan
    try:
        yield stack[-1]
    finally:
        stack.pop()
        with _SCAN_PATCH["lock"]:
            _SCAN_PATCH["users"] -= 1
            if not _SCAN_PATCH["users"]:
                lax.associative_scan = _ASSOCIATIVE_SCAN


def _scan_counts(params, n_in):
    """``(consts, carry)`` operand counts of a ``scan`` equation.

    jax up to 0.10 names them ``num_consts`` / ``num_carry``; jax 0.11 passes ``ft_in``, a flat
    tree that splits the operands into ``(consts, carry, xs)`` the way jax's own scan rules
    read it (``ft_in.update(operands).unpack()``).
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    groups = params.get("ft_in")
    try:
        consts, carry, _ = groups.update(list(range(n_in))).unpack()
    except (AttributeError, TypeError, ValueError):
        raise NotImplementedError(
            f"maskify: this jax version's scan parameters ({sorted(params)}) are not understood; expected "
            "num_consts/num_carry, or an ft_in that unpacks into (consts, carry, xs)."
        ) from None
    return len(consts), len(carry)
