"""Measurement: numerical parity between backends and against transformers (``parity``), the
benchmark harness (``bench``) and the run conditions every measurement records (``sysinfo``).
Built on the library (``normtools.core``) and the model cards (``normtools.cards``).
"""
