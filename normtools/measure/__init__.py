"""Measurement: numerical parity between backends and against transformers (``parity``) and the
benchmark harness (``bench``); the run conditions every measurement records come from
``normtools.core.sysinfo``.
Built on the library (``normtools.core``) and the model cards (``normtools.cards``).
"""
