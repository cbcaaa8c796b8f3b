"""Triton kernels of normtools, one file per family.

Installed as ``normtools._kernels``; these files hold ``@triton.jit`` kernels only (no torch
glue). The launchers that allocate tensors and pick block sizes live in ``normtools.core``
(each file's docstring says which); ``tiles`` holds the small helpers the kernels share
(``row_block``, ``load_param``, ``load_grad_tile``).
"""
