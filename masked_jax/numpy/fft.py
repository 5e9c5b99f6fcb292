"""``masked_jax.numpy.fft``: the FFT extension, for fully valid arrays.

A transform mixes every entry into every output, so it has no masked meaning: each function takes
fully valid arrays (a concrete all-True mask) and raises ``TypeError`` on any other.

Examples:
    >>> import masked_jax.numpy as mnp
    >>> mnp.fft.fft(mnp.ones(4)).real
    MaskedArray([4.0 0.0 0.0 0.0], dtype=float32)
"""

import jax.numpy as jnp

from masked_jax.numpy._common import dense_only

fft = dense_only(jnp.fft.fft, "fft.fft")
ifft = dense_only(jnp.fft.ifft, "fft.ifft")
fftn = dense_only(jnp.fft.fftn, "fft.fftn")
ifftn = dense_only(jnp.fft.ifftn, "fft.ifftn")
rfft = dense_only(jnp.fft.rfft, "fft.rfft")
irfft = dense_only(jnp.fft.irfft, "fft.irfft")
rfftn = dense_only(jnp.fft.rfftn, "fft.rfftn")
irfftn = dense_only(jnp.fft.irfftn, "fft.irfftn")
hfft = dense_only(jnp.fft.hfft, "fft.hfft")
ihfft = dense_only(jnp.fft.ihfft, "fft.ihfft")
fftfreq = dense_only(jnp.fft.fftfreq, "fft.fftfreq")
rfftfreq = dense_only(jnp.fft.rfftfreq, "fft.rfftfreq")
fftshift = dense_only(jnp.fft.fftshift, "fft.fftshift")
ifftshift = dense_only(jnp.fft.ifftshift, "fft.ifftshift")

__all__ = [
    "fft",
    "ifft",
    "fftn",
    "ifftn",
    "rfft",
    "irfft",
    "rfftn",
    "irfftn",
    "hfft",
    "ihfft",
    "fftfreq",
    "rfftfreq",
    "fftshift",
    "ifftshift",
]
