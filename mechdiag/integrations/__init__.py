"""Other trainers: the recorder inside TRL's GRPOTrainer (trl.py) and readers of TRL and verl runs (readers.py).

Heavy imports (trl, transformers) stay inside the functions that need them, so reading a run needs neither.
"""
