"""A user's script, run from outside the repository against an installed wheel: the three jobs
the library is for, checked against references computed here."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import masked_jax as mj
import masked_jax.nn as mnn
import masked_jax.numpy as mnp
from masked_jax import optim

assert "site-packages" in mj.__file__, f"expected the installed package, imported {mj.__file__}"

# Masked arithmetic against numpy.ma (which inverts the mask).
data = np.array([[1.0, np.nan, 3.0], [4.0, 5.0, np.inf]], np.float32)
mask = np.array([[True, False, True], [True, True, False]])
x = mj.masked_array(jnp.asarray(data), jnp.asarray(mask))
ref = np.ma.masked_array(data, ~mask)
np.testing.assert_allclose(mnp.mean(x, axis=1).filled(0.0), ref.mean(axis=1).filled(0.0), rtol=1e-6)

# A masked gradient: exactly zero, never NaN, under the mask.
g = mj.grad(lambda v: mnp.sum(mnp.log(v)))(x)
assert bool(jnp.all(jnp.isfinite(g.data))) and g.mask.tolist() == mask.tolist()

# A masked optax chain: only the valid entries move.
params = jnp.ones((2, 3))
opt = optim.lazy(optax.adam(0.1))
updates, _ = opt.update(mj.masked_array(jnp.ones((2, 3)), jnp.asarray(mask)), opt.init(params))
moved = np.asarray(optim.apply_updates(params, updates)) != 1.0
assert moved.tolist() == mask.tolist(), moved


# A jitted embedding step with row-sparse gradients and a donated table.
def loss_fn(p, ids):
    return jnp.mean((mj.lookup(p["table"], ids) - 1.0) ** 2)


step = optim.make_train_step(loss_fn, optim.lazy(optax.adam(0.1)), row_sparse=True)
p = {"table": jnp.zeros((1000, 8))}
state = optim.lazy(optax.adam(0.1)).init(p)
losses = []
for _ in range(5):
    p, state, loss = step(p, state, jnp.array([3, 7, 7]))
    losses.append(float(loss))
assert losses[-1] < losses[0], losses
assert int(jnp.sum(jnp.any(p["table"] != 0, axis=1))) == 2  # only rows 3 and 7 moved

# maskify on plain JAX code, and a Jacobian check that tells masked from dense semantics.
probs = mj.maskify(jax.nn.softmax)(x)
np.testing.assert_allclose(probs.filled(0.0)[0], [1 / (1 + np.e**2), 0.0, np.e**2 / (1 + np.e**2)], rtol=1e-5)
report = mj.check_jacobian(lambda v: mnn.softmax(v, axis=1), (x,), raise_exception=False)
assert report.satisfies == ("masked",), report

print(
    f"masked_jax {mj.__version__} with jax {jax.__version__}, optax {optax.__version__}, "
    f"numpy {np.__version__}: the user script passed"
)
