"""normtools.qk_norm / QKNorm: per-head and per-layer QK-Norm against float64 math.

The oracle normalizes each head (per_head) or each token's whole projection (per_layer) in
float64 with ``rms_norm_f64``; "same" is the reference RMSNorm in the input dtype applied to the
same rows. On CPU the Triton kernel runs under the interpreter (small shapes); the same tests
run compiled on CUDA (``-m gpu``), plus larger shapes there.
"""

import math
import os
import subprocess
import sys

import pytest
import torch
import triton
from _oracle import (
    DEVICES,
    DTYPES,
    HYPOTHESIS_SETTINGS,
    assert_close_to_oracle,
    rms_norm_f64,
    run_with_grads,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import normtools
from normtools.core import launch_hooks, launch_plans, launcher
from normtools._kernels import qk_norm as _k
from normtools.core import qk as qk_module
from normtools.core.reference import rms_norm_reference

SETTINGS = settings(HYPOTHESIS_SETTINGS, max_examples=15)
EPS = 1e-6


def make_qk(lead, hq, hk, head_dim, dtype, device, headed, fused, seed):
    """q (lead..., Hq·D) and k (lead..., Hk·D), or (..., H, D) when ``headed``; with ``fused``
    they are column slices of one qkv projection output (row stride larger than the width)."""
    gen = torch.Generator().manual_seed(seed)
    wq, wk = hq * head_dim, hk * head_dim
    if fused:
        qkv = torch.randn(*lead, wq + 2 * wk, generator=gen)
        q, k = qkv[..., :wq], qkv[..., wq:wq + wk]
    else:
        q, k = torch.randn(*lead, wq, generator=gen), torch.randn(*lead, wk, generator=gen)
    q, k = q.to(device, dtype), (2 * k).to(device, dtype)
    if headed:
        q, k = q.unflatten(-1, (hq, head_dim)), k.unflatten(-1, (hk, head_dim))
    return q, k


def make_weight(shape, offset, dtype, device, gen):
    """Weight whose effective scale offset + w lies in [0.5, 1.5]."""
    return (0.5 - offset + torch.rand(shape, generator=gen)).to(device, dtype)


def weight_shape(kind, heads, head_dim):
    return {"shared": (head_dim,), "per_head": (heads, head_dim),
            "per_layer": (heads * head_dim,)}[kind]


def rowwise(norm, x, w, heads, head_dim, per_layer, headed):
    """Apply the single-tensor RMSNorm ``norm(rows, w)`` to the statistics rows of x, written
    directly with views: per_layer rows are (..., H·D), per_head rows (..., H, D)."""
    flat = x.flatten(-2) if headed else x
    rows = flat if per_layer else flat.unflatten(-1, (heads, head_dim))
    return norm(rows, w).reshape(x.shape)


def check_qk(device, backend, lead, hq, hk, head_dim, kind, dtype, weight_dtype, casting, offset,
             headed=False, fused=False, seed=0):
    """Outputs and all four gradients of qk_norm against the float64 oracle."""
    scope = "per_layer" if kind == "per_layer" else "per_head"
    per_layer = scope == "per_layer"
    q, k = make_qk(lead, hq, hk, head_dim, dtype, device, headed, fused, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    qw = make_weight(weight_shape(kind, hq, head_dim), offset, weight_dtype, device, gen)
    kw = make_weight(weight_shape(kind, hk, head_dim), offset, weight_dtype, device, gen)

    def kernel(q, k, qw, kw):
        return normtools.qk_norm(q, k, qw, kw, EPS, head_dim=head_dim, scope=scope, offset=offset,
                                 casting=casting, backend=backend)

    def same(q, k, qw, kw):
        def norm(x, w):
            return rms_norm_reference(x, w, EPS, offset, casting)
        return (rowwise(norm, q, qw, hq, head_dim, per_layer, headed),
                rowwise(norm, k, kw, hk, head_dim, per_layer, headed))

    def oracle(q, k, qw, kw):
        def norm(x, w):
            return rms_norm_f64(x, w, EPS, offset)
        return (rowwise(norm, q, qw, hq, head_dim, per_layer, headed),
                rowwise(norm, k, kw, hk, head_dim, per_layer, headed))

    with torch.no_grad():
        like = same(q, k, qw, kw)
    dys = [torch.randn(o.shape, generator=gen).to(device, o.dtype) for o in like]
    inputs = (q, k, qw, kw)
    outs, grads = run_with_grads(kernel, inputs, dys)
    outs_same, grads_same = run_with_grads(same, inputs, dys)
    outs64, grads64 = run_with_grads(oracle, inputs, dys, cast=torch.float64)
    for name, out, ref, s in zip(["q_out", "k_out"], outs, outs64, outs_same):
        assert out.shape == s.shape and out.dtype == s.dtype, name
        assert_close_to_oracle(out, ref, s, dtype, name)
    for name, g, ref, s in zip(["dq", "dk", "dq_weight", "dk_weight"], grads, grads64, grads_same):
        assert g.shape == s.shape and g.dtype == s.dtype, name
        assert_close_to_oracle(g, ref, s, dtype, name)


@st.composite
def cases(draw):
    lead = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    hk = draw(st.sampled_from([1, 2, 3]))
    hq = hk * draw(st.sampled_from([1, 2, 4]))           # GQA: Hk divides Hq
    head_dim = draw(st.sampled_from([4, 16, 24, 64, 128]))
    kind = draw(st.sampled_from(["shared", "per_head", "per_layer"]))
    dtype = draw(st.sampled_from(DTYPES))
    weight_dtype = draw(st.sampled_from([torch.float32, dtype]))
    casting = draw(st.sampled_from(["llama", "gemma"]))
    offset = draw(st.sampled_from([0.0, 1.0, 0.5]))
    headed, fused = draw(st.booleans()), draw(st.booleans())
    return lead, hq, hk, head_dim, kind, dtype, weight_dtype, casting, offset, headed, fused


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
@SETTINGS
@given(case=cases())
def test_matches_float64(device, backend, case):
    check_qk(device, backend, *case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["shared", "per_head", "per_layer"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("headed", [False, True])
def test_gqa_shapes(device, kind, dtype, headed):
    """Qwen3-like GQA (8 q heads, 2 k heads, head_dim 128), both layouts, all dtypes."""
    casting, offset = ("gemma", 1.0) if dtype == torch.bfloat16 else ("llama", 0.0)
    check_qk(device, "triton", (2, 3), 8, 2, 128, kind, dtype, dtype, casting, offset,
             headed=headed, fused=not headed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lead, hq, hk, head_dim, kind", [
    ((0,), 4, 2, 16, "shared"),          # no tokens
    ((1,), 1, 1, 1, "per_layer"),        # one element per row
    ((3,), 72, 8, 128, "per_layer"),     # q row of 9216 fp32 values: the chunked loop
    ((2, 1), 2, 1, 8, "per_head"),
])
def test_edge_shapes(device, lead, hq, hk, head_dim, kind):
    check_qk(device, "triton", lead, hq, hk, head_dim, kind, torch.float32, torch.float32,
             "llama", 0.0, fused=True)


@pytest.mark.parametrize("kind", ["shared", "per_head", "per_layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_programs_and_chunks(kind, dtype, monkeypatch):
    """Small tiles and chunks on CPU: several token blocks per head (dw summed over partial
    rows) and rows longer than a chunk (the two-pass loops), as on CUDA at scale."""
    monkeypatch.setitem(launch_plans.TILE_ELEMENTS, "cpu", 128)
    monkeypatch.setattr(launch_plans, "MAX_CHUNK_BYTES", 64)     # 16 fp32 or 32 bf16 per chunk
    check_qk("cpu", "triton", (2, 5), 4, 2, 40, kind, dtype, torch.float32, "gemma", 0.5,
             fused=True)


@pytest.mark.parametrize("kind, hq, hk, lead, programs", [
    ("shared", 10, 5, (2, 4), 10), ("per_head", 10, 5, (2, 4), 10),
    ("per_layer", 4, 2, (2, 3), 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paired_q_and_k_programs(kind, hq, hk, lead, programs, dtype, monkeypatch,
                                 nan_filled_float32):
    """A paired plan (launch_plans.pair_programs): rows of one head (D = 16) a block, and as
    many programs allowed as tokens, so that a token's q and k rows together are a shorter
    program than the split's (per head, Hq = 10 and Hk = 5: 15 heads against 16 head-tokens;
    per layer, q's row of 4 heads and k's of 2: 6 against 8). Each grid program runs the q
    program and the k program of its token, forward and backward, into float32 buffers full of
    NaN: a grid program that ran only its first program leaves k unwritten and cannot pass."""
    n_tokens, per_layer = lead[0] * lead[1], kind == "per_layer"
    monkeypatch.setitem(launch_plans.TILE_ELEMENTS, "cpu", 16 * (hq if per_layer else 1))
    monkeypatch.setattr(launch_plans, "CPU_PROGRAMS", programs)
    rows = (hq * 16, hk * 16, 1, 1) if per_layer else (16, 16, hq, hk)
    for kernel in ("qk_norm_fwd", "qk_norm_bwd"):
        plan = qk_module.launch_shape(kernel, n_tokens, *rows, dtype, "cpu")[0]
        assert plan.block_m == 1 and [(s.slots, s.groups, s.rows_per_program)
                                      for s in plan.shares] == [(1, n_tokens, 1)] * 2, kernel
        assert plan.programs == n_tokens, kernel     # half the shares' programs
    check_qk("cpu", "triton", lead, hq, hk, 16, kind, dtype, torch.float32, "gemma", 0.5,
             fused=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["shared", "per_head", "per_layer"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead, hq, hk, head_dim", [((4, 1024), 32, 8, 128),
                                                    ((3, 333), 64, 8, 128),
                                                    ((2, 100), 48, 8, 128)])
def test_large_shapes_cuda(kind, dtype, lead, hq, hk, head_dim):
    check_qk("cuda", "triton", lead, hq, hk, head_dim, kind, dtype, dtype, "gemma", 1.0,
             fused=True)


def _compile_for_sm90(kernel, pointers, constexprs, num_warps):
    """Compile a @triton.jit kernel to a cubin for compute capability 9.0 (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature = {name: "constexpr" if name in constexprs else pointers.get(
        name, "fp32" if name in ("eps", "offset") else "i32") for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={
        (kernel.arg_names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


def compile_kernels_for_sm90():
    """Compile forward and backward for sm_90 with the launcher's CUDA block sizes: a per-head
    tile (bf16), a one-chunk per_layer row (fp32) and a chunked one (fp32, 9216 > 8192).
    Needs TRITON_INTERPRET unset."""
    for nq, nk, dtype, size in ((128, 128, "bf16", 2), (6144, 1024, "fp32", 4),
                                (9216, 1024, "fp32", 4)):
        with launch_hooks.planning_for_cuda():
            plan, block_nq, block_nk = qk_module.launch_shape(
                "qk_norm_bwd", 4096, nq, nk, 1, 1, torch.bfloat16 if size == 2 else torch.float32,
                "cpu")
        rows, num_warps = plan.block_m, plan.num_warps
        sizes = dict(NQ=nq, NK=nk, BLOCK_M=rows, BLOCK_NQ=block_nq, BLOCK_NK=block_nk,
                     QW_PER_HEAD=False, KW_PER_HEAD=False, PAIRED=plan.paired)
        pointers = {name: f"*{dtype}" for name in ("Q", "K", "QW", "KW", "QY", "KY", "DQY", "DKY",
                                                  "DQ", "DK")}
        pointers |= {name: "*fp32" for name in ("Q_RSTD", "K_RSTD", "DQW_PARTIAL", "DKW_PARTIAL")}
        for kernel, constexprs in ((_k.qk_norm_fwd, sizes | {"ROUND_XHAT": True,
                                                              "NUM_STAGES": plan.num_stages}),
                                   (_k.qk_norm_bwd, sizes)):
            assert "cubin" in _compile_for_sm90(kernel, pointers, constexprs, num_warps).asm


def test_kernels_compile_for_cuda():
    """The interpreter accepts more than the compiler does: both kernels must compile to a
    cubin for sm_90 (in a fresh process without TRITON_INTERPRET; no GPU needed)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),  # tests/_oracle.py
                                         env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", "import test_qk_norm as t; "
                           "t.compile_kernels_for_sm90(); print('ok')"],
                          cwd=os.path.dirname(__file__), env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("device", DEVICES)
def test_one_launch_forward_and_backward(device, monkeypatch):
    """q and k share one kernel launch in each direction."""
    launches = []
    kernel_for = qk_module.kernel_for

    def counting(kernel, dev):
        launches.append(kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel))
        return kernel_for(kernel, dev)

    monkeypatch.setattr(qk_module, "kernel_for", counting)
    q, k = make_qk((3, 5), 4, 2, 16, torch.float32, device, True, False, 0)
    qw = torch.ones(16, device=device, requires_grad=True)
    kw = torch.ones(16, device=device, requires_grad=True)
    qo, ko = normtools.qk_norm(q, k, qw, kw, head_dim=16, backend="triton")
    assert len(launches) == 1
    (qo.sum() + ko.sum()).backward()
    assert len(launches) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_stride0_upstream_gradient_and_single_output(device):
    """qo.sum().backward() hands the op an expanded (stride-0) gradient for q and none for k."""
    q, k = make_qk((2, 3), 4, 2, 16, torch.float32, device, False, False, 1)
    qw = torch.linspace(0.5, 1.5, 16, device=device)
    grads = {}
    for backend, dtype in (("triton", torch.float32), ("oracle", torch.float64)):
        ql, wl = q.detach().to(dtype).requires_grad_(), qw.detach().to(dtype).requires_grad_()
        kl = k.detach().requires_grad_()
        if backend == "oracle":
            qo = rms_norm_f64(ql.unflatten(-1, (4, 16)), wl).flatten(-2)
        else:
            qo, _ = normtools.qk_norm(ql, kl, wl, qw, head_dim=16, backend=backend)
        qo.sum().backward()
        grads[backend] = (ql.grad, wl.grad)
        if backend == "triton":
            assert torch.equal(kl.grad, torch.zeros_like(k))
    for got, ref in zip(grads["triton"], grads["oracle"]):
        assert_close_to_oracle(got, ref, None, torch.float32, "stride-0 grad")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["shared", "per_layer"])
def test_weight_grads_are_deterministic(device, kind, monkeypatch):
    """dw from per-program partial rows is bitwise identical run to run (many programs)."""
    tokens = 64 if device == "cpu" else 20000
    monkeypatch.setitem(launch_plans.TILE_ELEMENTS, "cpu", 1024)     # 4 token blocks on CPU
    q, k = make_qk((tokens,), 8, 2, 64, torch.bfloat16, device, False, False, 3)
    shape = weight_shape(kind, 8, 64), weight_shape(kind, 2, 64)
    scope = "per_layer" if kind == "per_layer" else "per_head"

    def weight_grads():
        qw = torch.ones(shape[0], device=device, dtype=torch.bfloat16, requires_grad=True)
        kw = torch.ones(shape[1], device=device, dtype=torch.bfloat16, requires_grad=True)
        qo, ko = normtools.qk_norm(q, k, qw, kw, head_dim=64, scope=scope, backend="triton")
        torch.autograd.backward([qo, ko], [q.flip(0), k.flip(0)])
        return qw.grad, kw.grad

    first, second = weight_grads(), weight_grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scope", ["per_head", "per_layer"])
def test_nonfinite_value_stays_in_its_row(device, scope):
    q, k = make_qk((6,), 4, 2, 16, torch.bfloat16, device, False, False, 5)
    qw = torch.full((64,) if scope == "per_layer" else (16,), 1.25, device=device,
                    dtype=torch.bfloat16)
    kw = qw[:32] if scope == "per_layer" else qw
    clean_q, clean_k = normtools.qk_norm(q, k, qw, kw, head_dim=16, scope=scope, backend="triton")
    for bad in (math.nan, math.inf):
        qb = q.clone()
        qb[2, 20] = bad                                  # token 2, head 1
        yq, yk = normtools.qk_norm(qb, k, qw, kw, head_dim=16, scope=scope, backend="triton")
        assert torch.equal(yk, clean_k)
        bad_cols = slice(0, 64) if scope == "per_layer" else slice(16, 32)
        others = torch.ones_like(yq, dtype=torch.bool)
        others[2, bad_cols] = False
        assert torch.equal(yq[others], clean_q[others])
        assert not torch.isfinite(yq[2, bad_cols]).all()


def test_bad_inputs_raise_before_launch():
    q, k = torch.randn(3, 64), torch.randn(3, 32)
    w = torch.ones(16)
    base = dict(q=q, k=k, q_weight=w, k_weight=w, eps=1e-6, head_dim=16, scope="per_head",
                offset=0.0, casting="llama", backend="triton")
    cases = [
        (ValueError, dict(head_dim=24)),                              # 24 does not divide 64
        (ValueError, dict(head_dim=0)),
        (ValueError, dict(k=torch.randn(3, 48))),                     # Hk = 3 does not divide 4
        (ValueError, dict(k=torch.randn(4, 32))),                     # different tokens
        (ValueError, dict(q=q.view(3, 4, 16), k=k)),                  # mixed layouts
        (ValueError, dict(q_weight=torch.ones(15))),
        (ValueError, dict(q_weight=torch.ones(3, 16))),               # 3 rows for 4 heads
        (ValueError, dict(scope="per_layer")),                        # (16,) is not (64,)
        (ValueError, dict(scope="per_layer", q_weight=torch.ones(64), k_weight=torch.ones(64))),
        (ValueError, dict(k_weight=torch.ones(16, device="meta"))),
        (ValueError, dict(k=k.to("meta"))),
        (TypeError, dict(q_weight=torch.ones(16, dtype=torch.float16))),
        (TypeError, dict(q_weight=[1.0] * 16)),
        (TypeError, dict(k=k.half())),
        (TypeError, dict(q=q.double(), k=k.double())),
        (TypeError, dict(q=q.to(torch.int32), k=k.to(torch.int32))),
        (ValueError, dict(eps=0.0)),
        (ValueError, dict(eps=math.nan)),
        (ValueError, dict(scope="per_token")),
        (ValueError, dict(casting="t5")),
        (ValueError, dict(backend="cuda")),
        (TypeError, dict(offset="1")),
    ]
    for error, change in cases:
        args = base | change
        with pytest.raises(error):
            normtools.qk_norm(args.pop("q"), args.pop("k"), args.pop("q_weight"),
                              args.pop("k_weight"), args.pop("eps"), **args)
    with pytest.raises(ValueError, match="divide"):
        normtools.qk_norm(q, torch.randn(3, 48), w, w, head_dim=16)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_compile_fullgraph(backend):
    q, k = make_qk((2, 3), 4, 2, 16, torch.float32, "cpu", True, False, 7)
    gen = torch.Generator().manual_seed(8)
    qw, kw = make_weight((64,), 0.0, torch.float32, "cpu", gen), make_weight((32,), 0.0,
                                                                                torch.float32,
                                                                                "cpu", gen)

    def f(q, k, qw, kw):
        return normtools.qk_norm(q, k, qw, kw, head_dim=16, scope="per_layer", backend=backend)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    dys = [torch.ones_like(q), torch.ones_like(k)]
    eager = run_with_grads(f, (q, k, qw, kw), dys)
    comp = run_with_grads(compiled, (q, k, qw, kw), dys)
    for a, b in zip(eager[0] + eager[1], comp[0] + comp[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_module():
    gemma = normtools.QKNorm(16, 4, 2, offset=1.0, casting="gemma", eps=1e-6)
    olmo = normtools.QKNorm(16, 4, 2, scope="per_layer", casting="gemma")
    cohere_like = normtools.QKNorm(16, 4, 2, weight_per_head=True)
    assert torch.equal(gemma.q_weight.detach(), torch.zeros(16))
    assert olmo.q_weight.shape == (64,) and olmo.k_weight.shape == (32,)
    assert cohere_like.k_weight.shape == (2, 16)
    assert "per_layer" in repr(olmo)
    q, k = make_qk((3,), 4, 2, 16, torch.float32, "cpu", True, False, 9)
    for module in (gemma, olmo, cohere_like):
        for backend in ("torch", "triton"):
            module.backend = backend
            qo, ko = module(q, k)
            # all scales start at 1: per_head / per_layer RMSNorm without a weight
            rows_q = q.flatten(-2) if module.scope == "per_layer" else q
            rows_k = k.flatten(-2) if module.scope == "per_layer" else k
            assert_close_to_oracle(qo.detach(), rms_norm_f64(rows_q).view(q.shape), None,
                                   torch.float32, "module q")
            assert_close_to_oracle(ko.detach(), rms_norm_f64(rows_k).view(k.shape), None,
                                   torch.float32, "module k")
    with pytest.raises(ValueError):
        normtools.QKNorm(16, 4, scope="global")
