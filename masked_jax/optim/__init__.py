"""Optax transformations with masked and row-sparse gradients.

``lazy(inner)`` lifts any optax transformation so that parameters and state change
only where the gradient is valid; ``masked_adagrad`` is Adagrad built that way;
``apply_updates`` applies dense, masked and row-sparse updates;
``make_train_step`` is the jitted, donated training step; ``sharded_update`` and
``init_sharded`` run it on tables sharded by rows over several devices.

Examples:
    >>> import jax.numpy as jnp, optax, masked_jax as mj
    >>> from masked_jax import optim
    >>> opt = optim.lazy(optax.sgd(1.0))
    >>> g = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))
    >>> updates, _ = opt.update(g, opt.init(jnp.zeros(2)))
    >>> optim.apply_updates(jnp.zeros(2), updates)
    Array([-1.,  0.], dtype=float32)
"""

from masked_jax.optim._adagrad import masked_adagrad as masked_adagrad
from masked_jax.optim._adagrad import rowwise_adagrad as rowwise_adagrad
from masked_jax.optim._adagrad import scale_by_rowwise_rss as scale_by_rowwise_rss
from masked_jax.optim._adagrad import scale_by_rss as scale_by_rss
from masked_jax.optim._apply import apply_updates as apply_updates
from masked_jax.optim._lazy import lazy as lazy
from masked_jax.optim._sharded import init_sharded as init_sharded
from masked_jax.optim._sharded import sharded_update as sharded_update
from masked_jax.optim._state import ScaleByRowwiseRssState as ScaleByRowwiseRssState
from masked_jax.optim._step import make_train_step as make_train_step

__all__ = [
    "ScaleByRowwiseRssState",
    "apply_updates",
    "init_sharded",
    "lazy",
    "make_train_step",
    "masked_adagrad",
    "rowwise_adagrad",
    "scale_by_rowwise_rss",
    "scale_by_rss",
    "sharded_update",
]
