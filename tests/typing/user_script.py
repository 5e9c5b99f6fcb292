"""A user's script, written as a new user would: pyright (basic mode) must report 0 errors on it."""

import jax
import jax.numpy as jnp
import optax

import masked_jax as mj
import masked_jax.nn as mnn
import masked_jax.numpy as mnp
from masked_jax import optim

x = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [True, True]]))
w = jnp.ones((2, 3))

# functions of masked_jax.numpy and masked_jax.nn, with keyword arguments
m = mnp.mean(x, axis=1, keepdims=True)
v = mnp.var(x, axis=0, ddof=1)
s = mnp.sum(x, axis=(0, 1), where=jnp.array([[True, True], [False, True]]))
q = mnp.quantile(x, 0.5, axis=1, method="linear")
n = mnp.norm(x, ord=2, axis=1)
p = mnn.softmax(x, axis=-1)
lp = mnn.log_softmax(x, axis=0)
e = mnp.exp(x) + mnp.log1p(mnp.abs(x))
c = mnp.concatenate([x, x], axis=0)
y = mnp.where(x > 2.0, x, 0.0)
z = mnp.einsum("ij,jk->ik", x, w)
count = mnp.count(x, axis=0)
r = mnp.reshape(x, (4,))

# operators with Python scalars and arrays, methods
a = x + 1.0
b = 2.0 * x - x / 3.0
d = x @ w
f = -(x**2)
g = (x >= 1.0) & (x < 4.0)
h = x.sum(axis=0).mean()
k = x.reshape(4).T
i = x[0] * jnp.array([1.0, 2.0])
filled: jax.Array = x.filled(0.0)
mask: jax.Array = x.mask


# the grad family
def loss(u: mj.MaskedArray) -> mj.MaskedArray:
    return mnp.sum(mnp.log1p(u * u))


grads = mj.grad(loss)(x)
value, grads2 = mj.value_and_grad(loss)(x)
jf = mj.jacfwd(lambda u: mnp.exp(u))(x)
jr = mj.jacrev(lambda u: mnn.softmax(u, axis=1))(x)

# optimizers inside an optax chain
opt = optax.chain(optax.clip(1.0), optim.lazy(optax.adam(1e-2)))
state = opt.init(jnp.zeros((2, 2)))
updates, state = opt.update(grads, state)
params = optim.apply_updates(jnp.zeros((2, 2)), updates)
adagrad = optim.masked_adagrad(0.1)

# the Jacobian checker and maskify
report = mj.check_jacobian(lambda u: mnp.sum(mnp.exp(u)), (x,), raise_exception=False)
ok: bool = bool(report)
layer_norm = mj.maskify(lambda u: (u - jnp.mean(u, axis=-1, keepdims=True)) / jnp.std(u, axis=-1, keepdims=True))
out = layer_norm(x)
