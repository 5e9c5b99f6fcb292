"""A short tour of masked semantics; ``make demo`` runs it (``python -m masked_jax.demo``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import masked_jax as mj
import masked_jax.nn as mnn
import masked_jax.numpy as mnp


def main() -> None:
    print(f"masked_jax {mj.__version__} on {jax.default_backend()}\n")
    print("Mask convention: True = valid (numpy.ma uses the opposite, and conversions invert it).")
    x = mj.masked_array(
        jnp.array([[1.0, jnp.nan, 3.0], [4.0, 5.0, -jnp.inf]]),
        jnp.array([[True, False, True], [False, False, False]]),
    )
    print("x =", x)
    print("NaN and -inf sit under the mask; nothing valid depends on them.\n")

    print("mean over rows    ", mnp.mean(x, axis=1), " <- a fully masked row is masked, not NaN")
    print("max over rows     ", mnp.max(x, axis=1))
    print("softmax over rows ", mnn.softmax(x, axis=1))
    print("x + [10, 20, 30]  ", x + jnp.array([10.0, 20.0, 30.0]))
    print("x @ ones((3, 2))  ", x @ jnp.ones((3, 2)), " <- sums only jointly valid terms")
    print("x.at[1, 0].set(7) ", x.at[1, 0].set(7.0), " <- setting makes an element valid")

    print("\nGradients never see masked-out values (no jnp.where NaN trap):")
    g = jax.grad(lambda d: mnp.sum(mnp.log(mj.masked_array(d, x.mask))).data)(x.data)
    print("d/dx sum(log(x)) =", np.asarray(g).tolist())

    print("\nUnder jit, with no retrace when only the mask changes:")
    f = jax.jit(lambda x: mnp.std(x, axis=1))
    print("std over rows     ", f(x))
    print("numpy.ma round trip:", mj.from_numpy_ma(x.to_numpy_ma()))


if __name__ == "__main__":
    main()
