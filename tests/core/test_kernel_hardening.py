"""Kernel defects the other tests cannot see (issues 31 and 34).

* Cluster plans (issue 31). Plans with ``num_ctas`` > 1 only on a Triton known to compile
  them correctly (launch_plans.CLUSTER_MIN_TRITON), the chunked row of the table otherwise; a
  chunked plan never spans a cluster (its barrier is CTA-scope); a compiled cluster kernel
  must carry the cluster instructions in its PTX. Every launch pins ``enable_fp_fusion`` and
  ``maxnreg``. On a GPU, the prefetching plan gives the default plan's bits.
* Casting in ulps for QK-Norm (both scopes) and the fused QK-Norm + RoPE (issue 34): the
  Triton output equals the reference of its own casting convention but on a tiny fraction of
  elements (one ulp away, two for "llama"'s double rounding), and on the elements where the two conventions' references differ it
  takes its own convention's value, so swapping "llama" and "gemma" in the launcher fails.
* k programs of QK-Norm with Hq ≠ Hk, several programs per slot and several heads per slot:
  on the default CPU plan every slot has one program, so a k program using q's head count,
  or a head of a slot left out, goes unseen.
* FlashAttention's rule for the norms' long and chunked rows, forward and backward: the
  kernel's error against float64 is at most FA_FACTOR times the error of PyTorch's own op in
  the same dtype, plus one ulp of the largest value. A mean over N − 1 values, or a chunked
  backward without its mean term, moves float32 results far past that.
* bfloat16 subnormals under the interpreter: Triton 3.9's interpreter mis-converts them on
  the bfloat16 → float32 upcast (normtools.core._triton_interpreter patches it); every
  bfloat16 bit pattern is upcast by a kernel and compared with torch's conversion.
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from _oracle import layer_norm_f64, rms_norm_f64, run_with_grads
from test_numerics import FA_FACTOR, MAX_ULP_MISMATCH_FRACTION, ulps

import normtools
from normtools.core import launch_hooks, launch_plans, launcher
from normtools.core import qk as qk_module
from normtools.core.reference import rms_norm_reference, rope_reference
from normtools.measure.spills import OPS
from normtools.measure.triton_runs import op_inputs, op_shape, run_on_triton

EPS = 1e-6
ROW_LENGTHS = [2 ** p for p in range(4, 19)] + [1000, 70001, 100000]


# ----------------------------------------------------------------------------- clusters

def _every_cuda_plan(capability=90):
    for kernel in launch_plans.KERNELS:
        for dtype in (torch.bfloat16, torch.float32):
            for n in ROW_LENGTHS:
                yield kernel, dtype, n, launch_plans.launch_plan(kernel, dtype, 64, n, "cuda",
                                                                 capability=capability)


@pytest.mark.parametrize("version", [(3, 8), (3, 0)])
def test_no_cluster_plans_before_the_checked_triton(version, monkeypatch):
    """On a Triton older than CLUSTER_MIN_TRITON no plan has a cluster: the long rows that
    sm_90 would launch on clusters take the chunked row of the table."""
    monkeypatch.setattr(launch_plans, "TRITON_VERSION", version)
    plans = list(_every_cuda_plan())
    assert all(plan.num_ctas == 1 for *_, plan in plans)
    forward = launch_plans.launch_plan("rms_norm_fwd", torch.bfloat16, 64, 32768, "cuda")
    assert not forward.single_pass and forward.block_n == 8192
    backward = launch_plans.launch_plan("rms_norm_bwd", torch.float32, 64, 16384, "cuda")
    assert not backward.single_pass and backward.block_n == 2048


def test_cluster_plans_on_the_checked_triton(monkeypatch):
    """On CLUSTER_MIN_TRITON the same rows are read once by a cluster (the branch the GPU
    runs takes clusters at all)."""
    monkeypatch.setattr(launch_plans, "TRITON_VERSION", launch_plans.CLUSTER_MIN_TRITON)
    forward = launch_plans.launch_plan("rms_norm_fwd", torch.bfloat16, 64, 32768, "cuda")
    assert forward.single_pass and forward.num_ctas == 2
    backward = launch_plans.launch_plan("rms_norm_bwd", torch.float32, 64, 16384, "cuda")
    assert backward.single_pass and backward.num_ctas == 2


def test_chunked_plans_never_span_a_cluster(monkeypatch):
    """Every plan of the table that has a cluster reads its row in one tile; a table row that
    asks for a chunked cluster is refused when the plan is made."""
    monkeypatch.setattr(launch_plans, "TRITON_VERSION", launch_plans.CLUSTER_MIN_TRITON)
    plans = list(_every_cuda_plan())
    assert any(plan.num_ctas > 1 for *_, plan in plans)
    assert all(plan.single_pass for *_, plan in plans if plan.num_ctas > 1)
    bad_row = launch_plans.RowConfig(launch_plans._ANY_N, 8192, 16, 8192, "chunked cluster",
                                     num_ctas=2, min_capability=90)
    monkeypatch.setitem(launch_plans.CUDA_ROW_CONFIGS, ("fwd", 2), (bad_row,))
    with pytest.raises(ValueError, match="CTA-scope"):
        launch_plans.launch_plan("rms_norm_fwd", torch.bfloat16, 64, 32768, "cuda")


PTX_OF_A_CLUSTER_REDUCTION = """
    mapa.shared::cluster.u32 %r41, %r40, %r39;
    st.shared::cluster.f32 [%r41], %f12;
    barrier.cluster.arrive.release.aligned;
    barrier.cluster.wait.acquire.aligned;
"""


def test_cluster_ptx_check():
    """A cluster kernel whose PTX lacks the cluster barrier or the remote shared-memory
    mapping is refused; one that has both, or a kernel on one CTA, passes."""
    launcher.check_cluster_ptx(PTX_OF_A_CLUSTER_REDUCTION, "rms_norm_fwd", 2)
    launcher.check_cluster_ptx("bar.sync 0;", "rms_norm_fwd", 1)
    for marker in launcher.CLUSTER_PTX_MARKERS:
        stripped = "\n".join(line for line in PTX_OF_A_CLUSTER_REDUCTION.splitlines()
                             if marker not in line)
        with pytest.raises(RuntimeError, match=marker):
            launcher.check_cluster_ptx(stripped, "rms_norm_fwd", 4)


@pytest.mark.gpu
def test_cluster_kernel_compiles_with_cluster_instructions():
    """On an sm_90 GPU, a row launched on a cluster runs (its PTX checked at the first
    compile) and matches float64."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("clusters need sm_90")
    x = torch.randn(4, 32768, device="cuda", dtype=torch.bfloat16)
    plan = launcher.plan_for("rms_norm_fwd", x.dtype, 4, 32768, x.device)
    assert plan.num_ctas == 2
    y = normtools.rms_norm(x, None, EPS, backend="triton")
    assert (y.double() - rms_norm_f64(x, None, EPS)).abs().max() < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("dtype, n", [(torch.bfloat16, 4096), (torch.float32, 1024),
                                      (torch.bfloat16, 32768)])
def test_prefetching_plan_gives_the_same_bits(norm, dtype, n):
    """On a GPU, a plan that prefetches (launch_hooks.prefetching(2): cp.async loads of the
    next row block) changes when rows are loaded, not the arithmetic: outputs and all
    gradients equal the default plan's bit for bit, over programs of several row blocks (M =
    4096) and a cluster (N = 32768 on sm_90); the default plan is checked against float64 by
    the kernel tests."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(4096, n, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(n, device="cuda", dtype=dtype, generator=gen)
    dy = torch.randn(4096, n, device="cuda", dtype=dtype, generator=gen)
    args = (w, torch.randn_like(w), 1e-5) if norm == "layer_norm" else (w, 1e-6)
    op = getattr(normtools, norm)

    def outputs():
        inputs = [t.detach().requires_grad_() for t in (x, *args[:-1])]
        y = op(inputs[0], *inputs[1:], args[-1], backend="triton")
        return (y, *torch.autograd.grad(y, inputs, dy))

    expected = outputs()
    with launch_hooks.prefetching(2):
        stages = launcher.plan_for(f"{norm}_fwd", dtype, 4096, n, x.device).num_stages
        got = outputs()
    assert stages == 2
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def _qk_plan(fused, scope, kernel, tokens, hq, hk, head_dim, dtype, device):
    """The launch plan of QK-Norm's (``fused``: QK-Norm + RoPE's) ``kernel`` on ``device``."""
    from normtools.core import rope as rope_module

    if fused:
        return rope_module.launch_shape(kernel, tokens, hq, hk, head_dim, scope == "per_layer",
                                        dtype, device)[0]
    rows = ((head_dim, head_dim, hq, hk) if scope == "per_head"
            else (hq * head_dim, hk * head_dim, 1, 1))
    return qk_module.launch_shape(kernel, tokens, *rows, dtype, device)[0]


def _qk_outputs(fused, scope, tokens, hq, hk, head_dim, dtype):
    """A function that runs QK-Norm (``fused``: QK-Norm + RoPE) on the Triton backend over
    random CUDA inputs of ``tokens`` tokens, forward and backward: its outputs, then the
    gradients of q, k and both weights."""
    gen = torch.Generator(device="cuda").manual_seed(hq * head_dim)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    q, k = randn(tokens, hq * head_dim), randn(tokens, hk * head_dim)
    rows = (head_dim, head_dim) if scope == "per_head" else (hq * head_dim, hk * head_dim)
    weights = [1 + 0.1 * randn(n) for n in rows]
    dq, dk = randn(*q.shape), randn(*k.shape)
    if fused:
        angles = torch.rand(tokens, head_dim // 2, device="cuda", generator=gen) * 100
        emb = torch.cat((angles, angles), -1)
        tables = (emb.cos().to(dtype), emb.sin().to(dtype))

        def forward(*tensors):
            return normtools.qk_norm_rope(*tensors, *tables, head_dim=head_dim, scope=scope,
                                          backend="triton")
    else:
        def forward(*tensors):
            return normtools.qk_norm(*tensors, head_dim=head_dim, scope=scope, backend="triton")

    def outputs():
        inputs = [t.detach().requires_grad_() for t in (q, k, *weights)]
        outs = forward(*inputs)
        return (*outs, *torch.autograd.grad(outs, inputs, (dq, dk)))

    return outputs


QK_PLAN_CASES = [("per_head", 32, 128), ("per_head", 64, 256), ("per_layer", 32, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["qk_norm", "qk_norm_rope"])
@pytest.mark.parametrize("scope, hq, head_dim", QK_PLAN_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_prefetching_qk_plan_gives_the_same_bits(fused, scope, hq, head_dim, dtype):
    """As above for QK-Norm and the fused QK-Norm + RoPE (4096 tokens, 8 k heads; 64 q heads
    of 256 put the fused backward's q row in several tiles): outputs and all gradients of the
    prefetching plan equal the default plan's bit for bit, and its launches prefetch (all but
    QK-Norm's backward, which launch_plans.PREFETCH_KERNELS leaves out)."""
    tokens, hk = 4096, 8
    outputs = _qk_outputs(fused, scope, tokens, hq, hk, head_dim, dtype)
    expected = outputs()
    family = "qk_norm_rope" if fused else "qk_norm"
    with launch_hooks.prefetching(2):
        assert [_qk_plan(fused, scope, f"{family}_{d}", tokens, hq, hk, head_dim, dtype,
                         "cuda").num_stages for d in ("fwd", "bwd")] == [2, 2 if fused else 1]
        got = outputs()
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["qk_norm", "qk_norm_rope"])
@pytest.mark.parametrize("scope, hq, head_dim", QK_PLAN_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_paired_qk_plan_matches_the_split_plan(fused, scope, hq, head_dim, dtype,
                                                monkeypatch):
    """A paired plan (launch_plans.pair_programs: a program normalizes the q and then the k
    rows of its tokens) at the first token count from 2048 on where this GPU's forward plan
    pairs, against the same launches planned without pairing: the outputs and the q and k
    gradients bit for bit (a token's row is computed alike whichever program takes it), the
    weight gradients (summed from other partial rows) within the dtype's tolerance."""
    hk, family = 8, "qk_norm_rope" if fused else "qk_norm"
    tokens = next((t for t in range(2048, 8192) if _qk_plan(
        fused, scope, f"{family}_fwd", t, hq, hk, head_dim, dtype, "cuda").paired), None)
    assert tokens is not None, "no paired forward plan from 2048 to 8191 tokens"
    outputs = _qk_outputs(fused, scope, tokens, hq, hk, head_dim, dtype)
    paired = outputs()
    def unpaired(*args, **kwargs):
        return launch_plans.launch_plan(*args, **{**kwargs, "pair_tensors": False})

    monkeypatch.setattr(launcher, "launch_plan", unpaired)
    assert not _qk_plan(fused, scope, f"{family}_fwd", tokens, hq, hk, head_dim, dtype,
                        "cuda").paired
    split = outputs()
    for a, b in zip(paired[:4], split[:4]):
        assert torch.equal(a, b)
    for a, b in zip(paired[4:], split[4:]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("op", OPS)
def test_every_launch_pins_fp_fusion_and_registers(op):
    """Every launch of every op, forward and backward, passes enable_fp_fusion=True and lets
    a thread have the registers of one CTA per SM, 65536 / threads (at most 255; the CUDA
    plans recorded, not run)."""
    inputs = op_inputs(op, op_shape(op, 1024, 8), torch.bfloat16)
    with (launch_hooks.planning_for_cuda(), launch_hooks.recording_launches() as launches):
        run_on_triton(op, inputs)
    assert launches
    for launch in launches:
        threads = 32 * launch.kwargs.get("num_warps", 4)
        assert launch.kwargs.get("enable_fp_fusion") is True, op
        assert launch.kwargs.get("maxnreg") == min(255, 65536 // threads), op


# ----------------------------------------------------------------------------- casting in ulps

def _qk_inputs(tokens, hq, hk, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(tokens, hq, head_dim, generator=gen)).to(torch.bfloat16)
    k = (3 * torch.randn(tokens, hk, head_dim, generator=gen)).to(torch.bfloat16)
    return q, k, gen


def _rows(x, scope):
    """x (T, H, D) as the rows one RMS covers: (T, H, D) per head, (T, H·D) per layer."""
    return x.flatten(-2) if scope == "per_layer" else x


# Largest distance in output ulps on the rare elements where the kernel's float32 rstd and the
# reference's differ in the last bit and flip a rounding: one for "gemma" (y rounded once);
# two for "llama", whose x_hat is rounded to bfloat16 first: one ulp of x_hat times s < 1 can
# be 1.5 ulps of a y in the binade below, rounded again to 2.
MAX_ULPS = {"gemma": 1, "llama": 2}


def _assert_own_casting(got, refs, casting, what):
    """``got`` equals refs[casting] but on a tiny fraction of elements (at most MAX_ULPS away)
    and takes refs[casting]'s value where the two conventions differ."""
    own, other = refs[casting], refs["gemma" if casting == "llama" else "llama"]
    distance = ulps(got, own, own.dtype)
    mismatch = (distance > 0).double().mean().item()
    assert distance.max() <= MAX_ULPS[casting] and mismatch <= MAX_ULP_MISMATCH_FRACTION, (
        f"{what}: up to {distance.max():.1f} ulps, {mismatch:.2%} of elements differ")
    conventions_differ = own != other
    assert conventions_differ.double().mean() > 0.05, what      # the test can fail
    assert (got[conventions_differ] == own[conventions_differ]).double().mean() > 0.99, what


@pytest.mark.parametrize("scope, weight_heads", [("per_head", False), ("per_head", True),
                                                 ("per_layer", True)],
                         ids=["per_head-shared", "per_head-per_head", "per_layer"])
@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_qk_norm_casting_in_ulps(scope, weight_heads, casting):
    """QK-Norm in bfloat16 (bfloat16 weights shared by the heads or one per head, Hq = 4,
    Hk = 2) against the reference RMSNorm of each casting convention applied to its rows."""
    q, k, gen = _qk_inputs(64, 4, 2, 64, seed=1)
    if scope == "per_layer":
        q_shape, k_shape = (4 * 64,), (2 * 64,)
    else:
        q_shape, k_shape = ((4, 64), (2, 64)) if weight_heads else ((64,), (64,))
    qw = (0.5 + torch.rand(q_shape, generator=gen)).to(torch.bfloat16)
    kw = (0.5 + torch.rand(k_shape, generator=gen)).to(torch.bfloat16)
    got = normtools.qk_norm(q, k, qw, kw, EPS, head_dim=64, scope=scope, casting=casting,
                            backend="triton")
    for x, w, y, name in ((q, qw, got[0], "q"), (k, kw, got[1], "k")):
        refs = {c: rms_norm_reference(_rows(x, scope), w, EPS, 0.0, c).reshape(x.shape)
                for c in ("llama", "gemma")}
        _assert_own_casting(y, refs, casting, f"{scope} {name} {casting}")


@pytest.mark.parametrize("scope", ["per_head", "per_layer"])
@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_qk_norm_rope_casting_in_ulps(scope, casting):
    """The fused QK-Norm + RoPE in bfloat16 with float32 rotary tables and ``cast_back``
    (OLMo 2's form: the rotation in float32, the result in the norm's bfloat16) against the
    reference norm of each convention, then the reference RoPE."""
    q, k, gen = _qk_inputs(32, 4, 2, 64, seed=2)
    angles = 3 * torch.randn(32, 32, generator=gen)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    shape = (64,) if scope == "per_head" else None
    qw = (0.5 + torch.rand(shape or (4 * 64,), generator=gen)).to(torch.bfloat16)
    kw = (0.5 + torch.rand(shape or (2 * 64,), generator=gen)).to(torch.bfloat16)
    got = normtools.qk_norm_rope(q, k, qw, kw, cos, sin, EPS, head_dim=64, scope=scope,
                                 casting=casting, cast_back=True, backend="triton")
    for x, w, y, name in ((q, qw, got[0], "q"), (k, kw, got[1], "k")):
        refs = {}
        for c in ("llama", "gemma"):
            normed = rms_norm_reference(_rows(x, scope), w, EPS, 0.0, c).reshape(x.shape)
            refs[c] = rope_reference(normed, cos[:, None], sin[:, None]).to(normed.dtype)
        _assert_own_casting(y, refs, casting, f"{scope} {name} {casting}")


# ----------------------------------------------------------------------------- k programs

@pytest.mark.parametrize("scope, weights, tokens, expected", [
    # many tokens: every head of q in one slot, 12 programs of one token; k's 2 heads, 6 of 2
    ("per_head", "shared", 12, ((1, 12, 1, 4), (1, 6, 2, 4))),
    ("per_head", "per_head", 12, ((1, 12, 1, 4), (1, 6, 2, 4))),
    # 3 tokens: a slot per head, 3 programs of one token each
    ("per_head", "shared", 3, ((4, 3, 1, 1), (2, 3, 1, 1))),
    ("per_head", "per_head", 3, ((4, 3, 1, 1), (2, 3, 1, 1))),
    # per layer, q's row twice k's
    ("per_layer", "per_layer", 12, ((1, 12, 1, 1), (1, 6, 2, 1))),
])
def test_k_programs_and_head_slots(scope, weights, tokens, expected, monkeypatch):
    """Hq = 4, Hk = 2, one token per tile, 18 programs allowed: the plan's programs of q and
    k, (slots, programs per slot, tokens per program, heads per slot), and q and k, outputs
    and all four gradients, against float64 (per-head weights: one partial row per token
    group and head)."""
    monkeypatch.setitem(launch_plans.TILE_ELEMENTS, "cpu", 16)
    monkeypatch.setattr(launch_plans, "CPU_PROGRAMS", 18)
    nq, nk, heads = (16, 16, (4, 2)) if scope == "per_head" else (64, 32, (1, 1))
    plan = qk_module.launch_shape("qk_norm_fwd", tokens, nq, nk, *heads, torch.float32, "cpu")[0]
    assert [(s.slots, s.groups, s.rows_per_program, s.units_per_slot)
            for s in plan.shares] == list(expected)
    q, k, gen = _qk_inputs(tokens, 4, 2, 16, seed=3)
    q, k = q.float(), k.float()
    q_shape, k_shape = {"shared": ((16,), (16,)), "per_head": ((4, 16), (2, 16)),
                        "per_layer": ((64,), (32,))}[weights]
    qw = 0.5 + torch.rand(q_shape, generator=gen)
    kw = 0.5 + torch.rand(k_shape, generator=gen)
    dq, dk = torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)

    def triton_qk(q, k, qw, kw):
        return normtools.qk_norm(q, k, qw, kw, EPS, head_dim=16, scope=scope, backend="triton")

    def oracle(q, k, qw, kw):
        return tuple(rms_norm_f64(_rows(x, scope), w, EPS).reshape(x.shape)
                     for x, w in ((q, qw), (k, kw)))

    outs, grads = run_with_grads(triton_qk, (q, k, qw, kw), [dq, dk])
    outs64, grads64 = run_with_grads(oracle, (q, k, qw, kw), [dq, dk], cast=torch.float64)
    for name, got, ref in zip(("q", "k", "dq", "dk", "dqw", "dkw"), outs + grads,
                              outs64 + grads64):
        err = (got.double() - ref).abs().max().item()
        assert err <= 1e-5 * max(ref.abs().max().item(), 1.0), (scope, name, err)


# ----------------------------------------------------------------------------- FlashAttention rule

def _torch_rms_norm(x, w):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, EPS)


def _torch_layer_norm(x, w, b):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


NORMS = {   # name: (Triton op, PyTorch's op, float64 oracle)
    "rms_norm": (lambda x, w, b: normtools.rms_norm(x, w, EPS, backend="triton"),
                 lambda x, w, b: _torch_rms_norm(x, w),
                 lambda x, w, b: rms_norm_f64(x, w, EPS)),
    "layer_norm": (lambda x, w, b: normtools.layer_norm(x, w, b, 1e-5, backend="triton"),
                   _torch_layer_norm,
                   lambda x, w, b: layer_norm_f64(x, w, b, 1e-5)),
}


@pytest.mark.parametrize("n, chunk_bytes", [(1000, None), (1000, 256), (4099, 1024),
                                            (70001, None)],
                         ids=["1000-single", "1000-chunked", "4099-chunked", "70001-chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_error_within_a_multiple_of_torchs(norm, dtype, n, chunk_bytes, monkeypatch):
    """y, dx, dw (and db) of 4 rows: max|kernel − float64| ≤ FA_FACTOR · max|torch same dtype −
    float64| + one ulp of max|float64|. Chunked rows at small N by shrinking the CPU chunk."""
    if chunk_bytes is not None:
        monkeypatch.setattr(launch_plans, "MAX_CHUNK_BYTES", chunk_bytes)
    plan = launcher.plan_for(f"{norm}_bwd", dtype, 4, n, "cpu")
    assert plan.single_pass == (chunk_bytes is None and n * dtype.itemsize <= 32768)
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(4, n, generator=gen) + 0.5).to(dtype)
    w = (1 + 0.2 * torch.randn(n, generator=gen)).to(dtype)
    b = (0.1 * torch.randn(n, generator=gen)).to(dtype)
    dy = torch.randn(4, n, generator=gen).to(dtype)
    kernel_op, torch_op, oracle = NORMS[norm]
    inputs = (x, w, b)
    got = run_with_grads(kernel_op, inputs, [dy])
    same = run_with_grads(torch_op, inputs, [dy])
    ref = run_with_grads(oracle, inputs, [dy], cast=torch.float64)
    names = ("y", "dx", "dw", "db")
    for name, g, s, r in zip(names, got[0] + got[1], same[0] + same[1], ref[0] + ref[1]):
        if norm == "rms_norm" and name == "db":
            continue
        spacing = torch.finfo(dtype).eps * r.abs().max().item()
        err, err_same = ((g.double() - r).abs().max().item(),
                         (s.double() - r).abs().max().item())
        assert err <= FA_FACTOR * err_same + spacing, (
            f"{norm} {dtype} N={n} {name}: error {err:.3g} vs torch's {err_same:.3g}")


# ----------------------------------------------------------------------------- bf16 subnormals

@triton.jit
def _upcast_bf16(X, Y, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(Y + offsets, tl.load(X + offsets).to(tl.float32))


def test_interpreter_upcasts_every_bfloat16_exactly():
    """Every bfloat16 bit pattern (subnormals, zeros, infinities, NaNs included) upcast to
    float32 by a kernel under the interpreter gives torch's float32 value (NaN for NaN)."""
    bits = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    y = torch.empty(x.shape, dtype=torch.float32)
    launcher.kernel_for(_upcast_bf16, x.device)[(1,)](x, y, BLOCK=2 ** 16)
    expected = x.float()
    assert torch.equal(y.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(y[finite], expected[finite])


def test_bfloat16_subnormal_rows():
    """RMSNorm of rows of bfloat16 subnormals (~1e-39; x² underflows, so y = x · w / √eps):
    the Triton kernel against the reference op in the same dtype, within one ulp."""
    gen = torch.Generator().manual_seed(4)
    x = (1e-39 * torch.randn(8, 64, generator=gen)).to(torch.bfloat16)
    assert (x.float().abs() < torch.finfo(torch.float32).tiny).float().mean() > 0.9
    w = (0.5 + torch.rand(64, generator=gen)).to(torch.bfloat16)
    y = normtools.rms_norm(x, w, EPS, backend="triton")
    ref = rms_norm_reference(x, w, EPS)
    assert ulps(y, ref, torch.bfloat16).max() <= 1
