"""mechdiag: a flight recorder and a mechanic for GRPO fine-tuning of small language models."""

__version__ = "0.1.0"
