"""``maskify``: ordinary ``jax.numpy`` code run with masked semantics, by interpreting its jaxpr.

Layer 4, beside :mod:`masked_jax.embeddings`: it reads the op registry's semantics through
``_rules`` (each primitive's masked rule, derived from the registry) and names the
``masked_jax.numpy`` / ``masked_jax.nn`` function to call in its error messages.

* ``_interpreter``: :func:`maskify` itself, the evaluation of a jaxpr on ``(data, mask)`` pairs;
* ``_rules``: the masked rule of each primitive, and the whole calls it recognises.
"""

from masked_jax._maskify._interpreter import MaskifyError as MaskifyError
from masked_jax._maskify._interpreter import maskify as maskify

__all__ = ["MaskifyError", "maskify"]
