"""mechdiag: a flight recorder and a mechanic for GRPO fine-tuning of small language models."""

__version__ = "0.1.0"


def displacement(a, b, base=None, by: str = "tensor", spectral: bool = False):
    """Weight displacement of checkpoint b against reference a as a pandas DataFrame (see mechdiag.displacement)."""
    from mechdiag.displacement import displacement as _displacement

    return _displacement(a, b, base=base, by=by, spectral=spectral)


def __getattr__(name):  # lazy: `import mechdiag` stays fast, torch loads on first use
    if name == "shift":
        from mechdiag.probes.shift import shift

        return shift
    raise AttributeError(f"module 'mechdiag' has no attribute {name!r}")
