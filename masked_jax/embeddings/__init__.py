"""Embedding tables: row lookups, pooled bags, stacked tables, and row-sparse gradients of them.

Layer 6, beside ``masked_jax._maskify``: it builds on the array types and the layouts, and
``masked_jax``'s autodiff (one layer up) calls :func:`substitute_rows` and
:func:`as_row_sparse` when a gradient is asked for with ``row_sparse=``.

* ``_lookup``: :func:`lookup`;
* ``_row_grad``: the pass that replays a function's row reads, so that it can be differentiated
  with respect to the rows it read;
* ``_bags``: :func:`embedding_bag`, padded or ragged bags pooled into one row each;
* ``_tables``: :func:`stack_tables` and :class:`TableStack`, several tables in one array.
"""

from masked_jax.embeddings._bags import embedding_bag as embedding_bag
from masked_jax.embeddings._lookup import lookup as lookup

# for masked_jax's autodiff
from masked_jax.embeddings._row_grad import as_row_sparse as as_row_sparse
from masked_jax.embeddings._row_grad import substitute_rows as substitute_rows
from masked_jax.embeddings._tables import TableStack as TableStack
from masked_jax.embeddings._tables import stack_tables as stack_tables

__all__ = ["TableStack", "embedding_bag", "lookup", "stack_tables"]
