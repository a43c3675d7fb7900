"""mechdiag: a flight recorder and a mechanic for GRPO fine-tuning of small language models."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import mechdiag` stays fast, torch loads on first use
    if name == "shift":
        from mechdiag.probes.shift import shift

        return shift
    raise AttributeError(f"module 'mechdiag' has no attribute {name!r}")
