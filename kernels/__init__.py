"""Triton kernels of normtools, one file per family.

Installed as ``normtools._kernels``; these files hold ``@triton.jit`` kernels only (no torch
glue). The launchers that allocate tensors and pick block sizes live in ``normtools``.
"""
