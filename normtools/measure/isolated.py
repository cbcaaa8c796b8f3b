"""Run one function in a fresh Python process and return its result.

Some measurements need a process that has not done something else first: Triton cannot
compile a kernel ahead of time (``normtools.measure.spills``) in a process that has already
run that kernel in its interpreter, which a chapter does before it reaches the spill table.
``run_isolated("normtools.measure.spills:spill_table", ops=...)`` imports the function in a
child process (the same interpreter, ``sys.executable``, and the same ``sys.path``), calls it with
the arguments, and sends the result back pickled; an exception in the child is raised here as
``RuntimeError`` with the child's traceback.
"""

import os
import pickle
import subprocess
import sys

__all__ = ["run_isolated"]

_CHILD = r"""
import importlib, pickle, sys, traceback
target, args, kwargs = pickle.load(sys.stdin.buffer)
module, _, name = target.partition(":")
try:
    result = (True, getattr(importlib.import_module(module), name)(*args, **kwargs))
except BaseException:
    result = (False, traceback.format_exc())
sys.stdout.buffer.write(pickle.dumps(result))
"""


def run_isolated(target, *args, timeout=600, **kwargs):
    """``module:function`` called with ``args`` and ``kwargs`` in a new process; its result.

    Arguments and result must be picklable (tensors, dtypes, DataFrames are). The child's
    stderr (warnings) is dropped unless it fails.
    """
    if ":" not in target:
        raise ValueError(f"target must be 'module:function', got {target!r}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", _CHILD],
                          input=pickle.dumps((target, args, kwargs)),
                          capture_output=True, timeout=timeout, env=env)
    if done.returncode != 0 or not done.stdout:
        raise RuntimeError(f"{target} failed in its process (exit {done.returncode}):\n"
                           f"{done.stderr.decode(errors='replace')[-3000:]}")
    ok, result = pickle.loads(done.stdout)
    if not ok:
        raise RuntimeError(f"{target} raised in its process:\n{result}")
    return result
