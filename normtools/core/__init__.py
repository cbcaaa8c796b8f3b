"""The library: what a user of normtools imports.

Ops (``ops``: ``rms_norm``, ``add_rms_norm``, ``layer_norm``), their modules (``modules``),
QK-Norm (``qk``), per-layer QK-Norm under tensor parallelism (``tp``), the plain-PyTorch
reference math (``reference``), and the glue that validates inputs and launches the Triton
kernels of ``kernels/``: ``validate``; ``launcher`` (the plan for the tensors, then the kernel
for their device); ``launch_plans`` (the CUDA launch table, written out row by row);
``launch_hooks`` (the extension point of measurement: plans of a GPU on CPU, recorded launches,
an observer of interpreted launches); ``_triton_interpreter`` (Triton's private API, in one
file). Also ``sysinfo``: what a run ran on (machine, accelerator, versions), which the lab, the
measurements and the book all record. Imports nothing above itself.
"""
