"""Hidden-state probes: nnsight capture of post-block residuals, activation shift, logit lens and output KL."""

from mechdiag.probes.shift import shift, shift_inmemory

__all__ = ["shift", "shift_inmemory"]
