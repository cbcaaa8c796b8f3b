"""normtools.measure.isolated: a function run in a fresh process, against the parent's state."""

import os

import pytest
import torch

from normtools.measure.isolated import run_isolated


def test_runs_in_another_process_with_fresh_state():
    assert run_isolated("os:getpid") != os.getpid()
    assert run_isolated("math:hypot", 3.0, 4.0) == 5.0
    total = run_isolated("torch:add", torch.ones(3), torch.full((3,), 2.0))
    assert torch.equal(total, torch.full((3,), 3.0))


def test_errors_come_back_with_the_childs_traceback():
    with pytest.raises(RuntimeError, match="ValueError"):
        run_isolated("math:sqrt", -1.0)
    with pytest.raises(RuntimeError, match="ModuleNotFoundError"):
        run_isolated("no_such_module:f")
    with pytest.raises(ValueError, match="module:function"):
        run_isolated("math.sqrt", 4.0)


def test_spill_table_after_an_interpreted_launch():
    """The reason it exists: ahead-of-time compilation fails in a process that has already
    interpreted the kernel; in a fresh process it works."""
    import normtools

    normtools.rms_norm(torch.randn(2, 64), torch.ones(64), backend="triton")
    table = run_isolated("normtools.measure.spills:spill_table", ops=("rms_norm_fwd_bwd",),
                         dtypes=(torch.bfloat16,), ns=(1024,), archs=(90,))
    assert len(table) >= 2 and {"registers", "spill_stores"} <= set(table.columns)
    assert (table["registers"] > 0).all()
