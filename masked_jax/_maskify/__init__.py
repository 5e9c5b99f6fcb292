"""``maskify``: ordinary ``jax.numpy`` code run with masked semantics, by interpreting its jaxpr.

Layer 6, beside :mod:`masked_jax.embeddings`: it reads the op registry's semantics through
``_rules`` (each primitive's masked rule, derived from the registry) and names the
``masked_jax.numpy`` / ``masked_jax.nn`` function to call in its error messages.

* ``_api``: :func:`maskify` itself: tracing, and the eager programs of unmasked calls;
* ``_interpreter``: the evaluation of a jaxpr on ``(data, mask)`` pairs, control flow included;
* ``_rules``: the masked rule of each primitive, derived from the registry;
* ``_recognise``: whole-call recognisers (softmax, means, named jax calls, ``associative_scan``);
* ``_constants``: what is known statically (values from literals, element counts of masked sums);
* ``_free``: free positions, constants beside masked data (concatenations, scatters);
* ``_spaces``: id spaces, which array's entries a gather's or a scatter's ids index;
* ``_rows``: which axis holds a batch's rows, if a jaxpr never mixes them (scans by whole rows);
* ``_scan``: the ``lax.associative_scan`` calls of a jaxpr, found by their equations' source;
* ``_calls``: library calls found the same way (``jax.nn.dot_product_attention``, flax's), run as
  their masked function;
* ``_custom``: ``custom_jvp`` / ``custom_vjp`` calls: the masked primal, the function's own
  derivative rule;
* ``_unique``: ``jnp.unique`` calls found the same way, run over the valid elements;
* ``_coords``: where padding lives, each axis's coordinates (padded, unpadded, built), read statically;
* ``_positions``: positional rules on those coordinates (slices, indices, windows, sorts);
* ``_ask``: :func:`mask_of` and :func:`lengths`, the mask read inside the function;
* ``_errors``: :class:`MaskifyError` and its messages.
"""

from masked_jax._maskify._api import maskify as maskify
from masked_jax._maskify._api import reusing_traces as reusing_traces  # for the checkers
from masked_jax._maskify._ask import lengths as lengths
from masked_jax._maskify._ask import mask_of as mask_of
from masked_jax._maskify._errors import MaskifyError as MaskifyError

__all__ = ["MaskifyError", "lengths", "mask_of", "maskify"]
