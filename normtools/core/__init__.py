"""The library: what a user of normtools imports.

Ops (``ops``: ``rms_norm``, ``add_rms_norm``, ``layer_norm``), their modules (``modules``),
QK-Norm (``qk``), per-layer QK-Norm under tensor parallelism (``tp``), the plain-PyTorch
reference math (``reference``), and the glue that validates inputs and launches the Triton
kernels of ``kernels/`` (``_validate``, ``_launch``). Imports nothing above itself.
"""
