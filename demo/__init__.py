"""The patchload demo (``make demo``) and the measurement code it shares with ``benchmarks/``."""
