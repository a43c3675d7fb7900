"""Other trainers: the recorder inside TRL's GRPOTrainer (trl.py) and readers of other trainers' runs (readers/).

Heavy imports (trl, transformers) stay inside the functions that need them, so reading a run needs neither.
"""
