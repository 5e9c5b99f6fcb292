"""Jacobian checks that know masked from dense semantics (the question of PyTorch's gradcheck discussion), compiled through XLA."""

from masked_jax.checking._check import check_jacobian as check_jacobian
from masked_jax.checking._invariance import InvarianceCase as InvarianceCase
from masked_jax.checking._invariance import InvarianceError as InvarianceError
from masked_jax.checking._invariance import InvarianceReport as InvarianceReport
from masked_jax.checking._invariance import check_invariance as check_invariance
from masked_jax.checking._report import Check as Check
from masked_jax.checking._report import JacobianError as JacobianError
from masked_jax.checking._report import JacobianReport as JacobianReport
