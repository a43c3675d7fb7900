"""mechdiag: a flight recorder and a mechanic for GRPO fine-tuning of small language models.

Python API: mechdiag.displacement.displacement(a, b) and mechdiag.probes.shift.shift(base, tuned, prompts);
the layers and where each idea lives: docs/architecture.md.
"""

__version__ = "0.1.0"
