"""normtools under DTensor tensor parallelism (normtools.core.tp_dtensor), gloo on 2 and 4 CPU ranks.

One spawn per world size runs every case (process start-up dominates the cost): a Llama-style
block with normtools RMSNorms under torchtitan's sequence-parallel plan, an OLMo 2-style block
with per-layer QK-Norm through ``QKNormParallel`` and through transformers' gather plan, each
against the same block in one process (forward, input gradient, every weight gradient), on the
default backend and on the custom-op path (backend="triton", interpreted on CPU); the bytes the
two OLMo 2 plans communicate against ``qk_path_bytes_per_token``; the ops' rules on
DTensors sharded on a normalized dimension (rejected) or on whole heads (run locally); and
OLMo 2 attention with fewer k heads than ranks (k and v heads replicated, as vLLM runs GQA)
through ``QKNormParallel`` against the same attention in float64 plain PyTorch, with the head
counts the ranks cannot hold rejected when the module is parallelized.
"""

import pytest
import torch

from normtools.core.reference import rope_reference, rope_tables
from normtools.measure import distributed, tp_blocks

SIZES = {"dim": 32, "num_heads": 8, "num_kv_heads": 4, "hidden": 64}
BATCH, SEQ = 2, 8
BLOCK_CASES = [("llama", "auto"), ("llama", "triton"), ("olmo2_allreduce", "auto"),
               ("olmo2_allreduce", "triton"), ("olmo2_gather", "auto")]
# 4 ranks on 2 cores is slow: there, one case per block and plan on the default backend
CASES_BY_WORLD_SIZE = {2: BLOCK_CASES, 4: [case for case in BLOCK_CASES if case[1] == "auto"]}


def op_rule_cases(rank, world_size):
    """Per-rank worker: what the ops do with DTensors sharded on the normalized dimension (the
    error message, or None if one ran) and the max abs error of a per_head QK-Norm of q and k
    sharded by heads, forward and backward, against one process."""
    import normtools
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8 * world_size, generator=gen)
    w = 1 + 0.1 * torch.randn(8 * world_size, generator=gen)
    rep_w, cols = distribute_tensor(w, mesh, [Replicate()]), distribute_tensor(x, mesh, [Shard(1)])
    q = torch.randn(4, 8 * 4, generator=gen)
    k = torch.randn(4, 4 * 4, generator=gen)
    calls = {
        "rms_norm": lambda b: normtools.rms_norm(cols, rep_w, backend=b),
        "add_rms_norm": lambda b: normtools.add_rms_norm(cols, cols, rep_w, backend=b),
        "layer_norm": lambda b: normtools.layer_norm(cols, rep_w, rep_w, backend=b),
        "qk_norm per_layer": lambda b: normtools.qk_norm(
            distribute_tensor(q, mesh, [Shard(1)]), distribute_tensor(k, mesh, [Shard(1)]),
            distribute_tensor(torch.ones(32), mesh, [Replicate()]),
            distribute_tensor(torch.ones(16), mesh, [Replicate()]),
            head_dim=4, scope="per_layer", backend=b),
    }
    rejected = {}
    for name, call in calls.items():
        try:
            call("triton")
            rejected[name] = None
        except RuntimeError as error:   # DTensor reports a failed rule as a RuntimeError
            rejected[name] = str(error)

    # per_head QK-Norm with q and k sharded by whole heads runs locally, weights replicated
    qk_weight = 1 + 0.1 * torch.randn(4, generator=gen)
    dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)
    leaves = [t.clone().requires_grad_() for t in (q, k, qk_weight, qk_weight)]
    q_ref, k_ref = normtools.qk_norm(*leaves, head_dim=4, backend="torch")
    ((q_ref * dq_out).sum() + (k_ref * dk_out).sum()).backward()
    shards = [distribute_tensor(t, mesh, [p]).requires_grad_()
              for t, p in ((q, Shard(1)), (k, Shard(1)), (qk_weight, Replicate()),
                           (qk_weight, Replicate()))]
    q_out, k_out = normtools.qk_norm(*shards, head_dim=4, backend="triton")
    ((q_out * distribute_tensor(dq_out, mesh, [Shard(1)])).sum()
     + (k_out * distribute_tensor(dk_out, mesh, [Shard(1)])).sum()).backward()
    per_head_error = max(
        [(q_out.full_tensor() - q_ref).abs().max().item(),
         (k_out.full_tensor() - k_ref).abs().max().item()]
        + [(s.grad.full_tensor() - leaf.grad).abs().max().item()
           for s, leaf in zip(shards, leaves)])
    return {"rejected": rejected, "per_head_error": per_head_error,
            "per_head_placements": (q_out.placements, shards[2].grad.placements)}


# ----------------------------------------------------------------------------- GQA, Hk < ranks

HEAD_DIM, GQA_DIM = 4, 16
# (Hq, Hk) with fewer k heads than ranks: every k head is replicated on P / Hk ranks
GQA_HEADS_BY_WORLD_SIZE = {2: [(4, 1)], 4: [(4, 1), (8, 2)]}
# (Hq, Hk) whose heads the ranks cannot hold whole: P does not divide H >= P, H < P does not
# divide P
UNSPLITTABLE_HEADS_BY_WORLD_SIZE = {2: [(4, 3), (3, 1)], 4: [(4, 3), (6, 2)]}
K_INPUTS = ("replicated", "local_head")


def rope_cos_sin(seq, head_dim):
    """cos, sin (1, 1, S, D) of transformers' default RoPE (``reference.rope_tables``), float64."""
    return tuple(t[None, None] for t in rope_tables(seq, head_dim, 10000.0, torch.float64))


class Olmo2Attention(torch.nn.Module):
    """OLMo 2 attention: per-layer QK-Norm of the q and k projections (normtools.QKNorm), RoPE,
    causal GQA attention, output projection. The number of local heads is read from the
    projections' outputs, so the same code runs whole or tensor-parallel."""

    def __init__(self, num_heads, num_kv_heads):
        super().__init__()
        from normtools.core.qk import QKNorm
        q_width, kv_width = num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM
        self.wq = torch.nn.Linear(GQA_DIM, q_width, bias=False)
        self.wk = torch.nn.Linear(GQA_DIM, kv_width, bias=False)
        self.wv = torch.nn.Linear(GQA_DIM, kv_width, bias=False)
        self.wo = torch.nn.Linear(q_width, GQA_DIM, bias=False)
        self.qk_norm = QKNorm(HEAD_DIM, num_heads, num_kv_heads, scope="per_layer")

    def forward(self, x, cos, sin):
        q, k = self.qk_norm(self.wq(x), self.wk(x))
        batch, seq = x.shape[:2]
        q, k, v = (t.reshape(batch, seq, -1, HEAD_DIM).transpose(1, 2)
                   for t in (q, k, self.wv(x)))
        q, k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def olmo2_attention_reference(x, weights, cos, sin, eps=1e-6):
    """The same attention in float64 plain PyTorch from the weights (q/k/v/o projections,
    q_norm and k_norm of the whole projections): r = rsqrt(mean(x², -1) + eps) over all heads,
    k and v heads repeated for their Hq / Hk q heads, softmax(q kᵀ / √D + causal mask) v."""
    def norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w
    batch, seq, _ = x.shape
    q = norm(x @ weights["wq.weight"].T, weights["qk_norm.q_weight"])
    k = norm(x @ weights["wk.weight"].T, weights["qk_norm.k_weight"])
    q, k, v = (t.reshape(batch, seq, -1, HEAD_DIM).transpose(1, 2)
               for t in (q, k, x @ weights["wv.weight"].T))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q, k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    scores = q @ k.transpose(-1, -2) / HEAD_DIM ** 0.5
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1)
    return out @ weights["wo.weight"].T


def gqa_weights(num_heads, num_kv_heads, seed=0):
    """float64 weights of an Olmo2Attention, the norms' weights off 1."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"wq.weight": (num_heads * HEAD_DIM, GQA_DIM),
              "wk.weight": (num_kv_heads * HEAD_DIM, GQA_DIM),
              "wv.weight": (num_kv_heads * HEAD_DIM, GQA_DIM),
              "wo.weight": (GQA_DIM, num_heads * HEAD_DIM)}
    weights = {name: torch.randn(shape, generator=gen, dtype=torch.float64) / GQA_DIM ** 0.5
               for name, shape in shapes.items()}
    for name, heads in (("qk_norm.q_weight", num_heads), ("qk_norm.k_weight", num_kv_heads)):
        weights[name] = 1 + 0.3 * torch.randn(heads * HEAD_DIM, generator=gen,
                                              dtype=torch.float64)
    return weights


def gqa_inputs(seed=1):
    """x and the output gradient dy, float64 (B, S, dim)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, SEQ, GQA_DIM, generator=gen, dtype=torch.float64)
            for _ in range(2)]


def gqa_replicated_k_cases(rank, world_size):
    """Per-rank worker: Olmo2Attention with fewer k heads than ranks, parallelized with
    column-parallel q, replicated k and v projections (every rank computes all Hk heads, as
    vLLM does), ``QKNormParallel`` and row-parallel o, forward and backward on a sequence-sharded
    input. k reaches the style as a replicated DTensor, or as this rank's head (a local
    tensor). Returns, per (Hq, Hk, k input), the whole output, input gradient and parameter
    gradients; and per unsplittable (Hq, Hk), the error ``parallelize_module`` raised (None if
    it raised none) and whether the module's weights were left plain tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle,
                                                   PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)
    from normtools.core.tp_dtensor import QKNormParallel

    class ReplicatedHeads(ParallelStyle):
        """A k or v projection with fewer heads than ranks: the weight replicated, its output
        a replicated DTensor, or with ``num_heads`` this rank's head, head ⌊rank·H/P⌋, as a
        local tensor whose gradient is Partial (the copies' gradients add up)."""

        def __init__(self, num_heads=None):
            super().__init__()
            self.num_heads = num_heads

        def _apply(self, module, mesh):
            def rank_head(_, out, mesh):
                head = mesh.get_local_rank() * self.num_heads // mesh.size()
                local = out.to_local(grad_placements=[Partial()])
                return local[..., head * HEAD_DIM:(head + 1) * HEAD_DIM]
            return distribute_module(module, mesh,
                                     output_fn=rank_head if self.num_heads else None)

    mesh = init_device_mesh("cpu", (world_size,))
    rows = slice(rank * SEQ // world_size, (rank + 1) * SEQ // world_size)   # Shard(1)
    x, dy = (t.float() for t in gqa_inputs())
    cos, sin = (t.float() for t in rope_cos_sin(SEQ, HEAD_DIM))
    results = {}
    for num_heads, num_kv_heads in GQA_HEADS_BY_WORLD_SIZE[world_size]:
        for k_input in K_INPUTS:
            block = Olmo2Attention(num_heads, num_kv_heads)
            block.load_state_dict({name: w.float() for name, w in
                                   gqa_weights(num_heads, num_kv_heads).items()})
            parallelize_module(block, mesh, PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None)))
            parallelize_module(block, mesh, {
                "wq": ColwiseParallel(),
                "wk": ReplicatedHeads(num_kv_heads if k_input == "local_head" else None),
                "wv": ReplicatedHeads(num_kv_heads),
                "qk_norm": QKNormParallel(),
                "wo": RowwiseParallel(output_layouts=Shard(1))})
            x_local = x[:, rows].clone().requires_grad_()
            y_local = block(x_local, cos, sin)
            (y_local * dy[:, rows]).sum().backward()
            results[(num_heads, num_kv_heads, k_input)] = {
                "output": DTensor.from_local(y_local.detach(), mesh, [Shard(1)]).full_tensor(),
                "input_grad": DTensor.from_local(x_local.grad, mesh, [Shard(1)]).full_tensor(),
                **{name: p.grad.full_tensor() for name, p in block.named_parameters()}}
    rejected = {}
    for num_heads, num_kv_heads in UNSPLITTABLE_HEADS_BY_WORLD_SIZE[world_size]:
        block = Olmo2Attention(num_heads, num_kv_heads)
        try:
            parallelize_module(block, mesh, {"qk_norm": QKNormParallel()})
            message = None
        except ValueError as error:
            message = str(error)
        untouched = not any(isinstance(p, DTensor) for p in block.qk_norm.parameters())
        rejected[(num_heads, num_kv_heads)] = (message, untouched)
    return {"blocks": results, "rejected": rejected}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"{p}ranks")
def runs(request):
    world_size = request.param
    calls = [(tp_blocks.run_block, (name,), {"backend": backend, "batch": BATCH, "seq": SEQ,
                                            **SIZES})
             for name, backend in CASES_BY_WORLD_SIZE[world_size]]
    calls += [(op_rule_cases, (), {}), (gqa_replicated_k_cases, (), {})]
    per_rank = distributed.spawn(distributed.run_all, world_size, calls)
    blocks = {case: [rank_results[i] for rank_results in per_rank]
              for i, case in enumerate(CASES_BY_WORLD_SIZE[world_size])}
    return (world_size, blocks, [rank_results[-2] for rank_results in per_rank],
            [rank_results[-1] for rank_results in per_rank])


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_parallel_block_matches_one_process(runs, case):
    """Forward, input gradient and every weight gradient of the parallelized block equal the
    single-process block's, on every rank (float32 round-off of a different summation order)."""
    world_size, blocks, _, _ = runs
    if case not in blocks:
        pytest.skip(f"{case} runs on 2 ranks only")
    for result in blocks[case]:
        errors = result["errors"]
        assert {"output", "input_grad", "attention_norm.weight", "ffn_norm.weight",
                "attention.wq.weight"} <= set(errors)
        if case[0].startswith("olmo2"):
            assert {"attention.qk_norm.q_weight", "attention.qk_norm.k_weight"} <= set(errors)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 2e-5 * result["scale"], (worst, errors[worst])


def test_qk_norm_allreduce_communicates_the_formula_bytes(runs):
    """The OLMo 2 plans differ only in the q/k path; the measured difference of the bytes a
    rank receives is qk_path_bytes_per_token times the tokens, and the all-reduce plan sends
    two all-reduces (forward, backward) where the gather plan sends four extra all-gathers."""
    world_size, blocks, _, _ = runs
    head_dim = SIZES["dim"] // SIZES["num_heads"]
    per_token = tp_blocks.qk_path_bytes_per_token(SIZES["num_heads"], SIZES["num_kv_heads"],
                                                  head_dim, world_size, dtype_bytes=4)
    for allreduce, gather in zip(blocks[("olmo2_allreduce", "auto")],
                                 blocks[("olmo2_gather", "auto")]):
        measured = gather["received"] - allreduce["received"]
        assert measured == pytest.approx((per_token["gather"] - per_token["allreduce"])
                                         * BATCH * SEQ)
        kinds = [kind for kind, _, _ in allreduce["calls"]]
        assert kinds.count("all_reduce") == 2
        assert ([kind for kind, _, _ in gather["calls"]].count("all_gather")
                == kinds.count("all_gather") + 4)


def test_normalized_dimension_shard_is_rejected(runs):
    """A DTensor sharded on the normalized dimension is refused with the rule's message (the
    op, the dimension, what to do); nothing is computed on the shard."""
    _, _, rules, _ = runs
    for result in rules:
        for name, message in result["rejected"].items():
            assert message is not None, f"{name} ran on a normalized-dimension shard"
            assert "sharded on dimension 1, the dimension it normalizes over" in message, message
            assert f"normtools.{name.split()[0]}" in message
        assert "QKNormParallel" in result["rejected"]["qk_norm per_layer"]


def test_per_head_qk_norm_runs_on_head_shards(runs):
    """per_head QK-Norm of q and k sharded by whole heads equals one process, forward and
    backward; its output stays sharded and the shared weight's gradient is a Partial sum."""
    _, _, rules, _ = runs
    for result in rules:
        assert result["per_head_error"] <= 1e-5
        out_placements, grad_placements = result["per_head_placements"]
        assert str(out_placements) == "(Shard(dim=1),)"
        assert str(grad_placements) in ("(Partial(sum),)", "(Replicate(),)")


@pytest.mark.parametrize("k_input", K_INPUTS)
def test_replicated_k_heads_match_one_process(runs, k_input):
    """GQA with fewer k heads than ranks through ``QKNormParallel`` (k a replicated DTensor, or
    this rank's head): on every rank, the output, the input gradient and every parameter
    gradient (q_norm and k_norm weights included) equal the float64 single-process attention
    (float32 round-off)."""
    world_size, _, _, gqa = runs
    cos, sin = rope_cos_sin(SEQ, HEAD_DIM)
    for num_heads, num_kv_heads in GQA_HEADS_BY_WORLD_SIZE[world_size]:
        assert num_kv_heads < world_size
        weights = {name: w.requires_grad_() for name, w in
                   gqa_weights(num_heads, num_kv_heads).items()}
        x, dy = gqa_inputs()
        x.requires_grad_()
        y = olmo2_attention_reference(x, weights, cos, sin)
        (y * dy).sum().backward()
        expected = {"output": y.detach(), "input_grad": x.grad,
                    **{name: w.grad for name, w in weights.items()}}
        for rank, result in enumerate(gqa):
            parallel = result["blocks"][(num_heads, num_kv_heads, k_input)]
            assert set(parallel) == set(expected)
            for name, want in expected.items():
                error = (parallel[name].double() - want).abs().max().item()
                assert error <= 1e-5 * want.abs().max().item(), (
                    num_heads, num_kv_heads, rank, name, error)


def test_heads_the_ranks_cannot_hold_are_rejected_before_computing(runs):
    """q or k heads that P ranks cannot hold whole (H ≥ P not a multiple of P, H < P not a
    divisor of P) make ``parallelize_module`` raise, naming the style, the weight and the
    counts, and leave the weights as they were."""
    world_size, _, _, gqa = runs
    for result in gqa:
        assert set(result["rejected"]) == set(UNSPLITTABLE_HEADS_BY_WORLD_SIZE[world_size])
        for (num_heads, num_kv_heads), (message, untouched) in result["rejected"].items():
            assert message is not None, f"{num_heads} q / {num_kv_heads} k heads were accepted"
            assert "QKNormParallel" in message and f"{world_size} ranks" in message, message
            assert untouched
