"""The library: what a user of normtools imports.

Ops (``ops``: ``rms_norm``, ``add_rms_norm``, ``layer_norm``), their modules (``modules``),
QK-Norm (``qk``) and QK-Norm fused with RoPE (``rope``), per-layer QK-Norm under tensor
parallelism on raw shards (``tp``) and in PyTorch's DTensor engine (``tp_dtensor``), the compute
dtype of a device (``precision``), the command line's one error path (``command_line``), the plain-PyTorch
reference math (``reference``), and the glue that validates inputs and launches the Triton
kernels of ``kernels/``: ``validate`` (the input checks); ``launcher`` (the plan for the tensors, then the kernel
for their device); ``launch_plans`` (the CUDA launch table, written out row by row); ``occupancy`` (the driver's
query of the clusters a GPU holds at once);
``launch_hooks`` (the extension point of measurement: plans of a GPU on CPU, recorded launches,
an observer of interpreted launches); ``_triton_interpreter`` (Triton's private API, in one
file). Also ``sysinfo``: what a run ran on (machine, accelerator, versions), which the lab, the
measurements and the book all record. Imports nothing above itself.
"""
