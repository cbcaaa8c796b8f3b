"""Measurement: what the library's ops compute, cost and do on a machine.

* ``parity``: numerical parity between backends and against transformers' norm modules.
* ``bench``: the benchmark harness (``normtools bench``), its own subpackage; the minimum bytes
  of each op are ``bench.minimum_bytes``.
* ``model_bench``: a transformers model's steps (forward, forward + backward) timed before and
  after ``normtools.patch``.
* ``op_costs``: operations and bytes per row of RMSNorm and LayerNorm (chapter 1).
* ``rms_vs_layer_norm``: how far RMSNorm is from LayerNorm on the same rows, and the rows the
  norms of a model receive (chapter 1).
* ``triton_runs``: an op run on the Triton backend, as the bytes counter and the spill report
  launch it.
* ``bytes_counter``: the bytes the Triton kernels touch, counted under the interpreter on the
  CUDA launch plan, against the minimum; ``l2_model`` replays those accesses through an L2.
* ``spills``: registers and spills of the kernels, compiled for each CUDA architecture.
* ``sm_balance``: how evenly each launch's programs keep the SMs busy (programs, CTAs, waves,
  SM-time efficiency) on an H200's and an A100's launch plan.
* ``oracle``: the tolerance of a result against a float64 oracle (the kernel tests' bound) and a
  run forward and backward on fresh leaves.
* ``cluster_check``: the GPU run's correctness pass over every thread-block cluster
  configuration (against float64, the torch backend and the chunked plan; repeats compared
  bitwise; the occupancy query per cluster size).
* ``isolated``: one function run in a fresh Python process.
* ``distributed``: processes for tensor-parallel runs (``spawn``, ``run_all``) and the bytes each
  collective moves (``CommBytes``); ``tp_blocks`` (a Llama- and an OLMo 2-style block under
  tensor-parallel plans) and ``tp_qk_norm`` (chapter 3's per-layer QK-Norm on raw shards) use it.

The run conditions every measurement records come from ``normtools.core.sysinfo``. Built on the
library (``normtools.core``) and the model cards (``normtools.cards``).
"""
