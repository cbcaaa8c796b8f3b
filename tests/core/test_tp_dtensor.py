"""normtools under DTensor tensor parallelism (normtools.core.tp_dtensor), gloo on 2 and 4 CPU ranks.

One spawn per world size runs every case (process start-up dominates the cost): a Llama-style
block with normtools RMSNorms under torchtitan's sequence-parallel plan, an OLMo 2-style block
with per-layer QK-Norm through ``QKNormParallel`` and through transformers' gather plan, each
against the same block in one process (forward, input gradient, every weight gradient), on the
default backend and on the custom-op path (backend="triton", interpreted on CPU); the bytes the
two OLMo 2 plans communicate against ``qk_path_bytes_per_token``; and the ops' rules on
DTensors sharded on a normalized dimension (rejected) or on whole heads (run locally).
"""

import pytest
import torch

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


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"{p}ranks")
def runs(request):
    world_size = request.param
    calls = [(tp_blocks.run_block, (name,), {"backend": backend, "batch": BATCH, "seq": SEQ,
                                            **SIZES})
             for name, backend in CASES_BY_WORLD_SIZE[world_size]]
    calls.append((op_rule_cases, (), {}))
    per_rank = distributed.spawn(distributed.run_all, world_size, calls)
    blocks = {case: [rank_results[i] for rank_results in per_rank]
              for i, case in enumerate(CASES_BY_WORLD_SIZE[world_size])}
    return world_size, blocks, [rank_results[-1] for rank_results in per_rank]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_parallel_block_matches_one_process(runs, case):
    """Forward, input gradient and every weight gradient of the parallelized block equal the
    single-process block's, on every rank (float32 round-off of a different summation order)."""
    world_size, blocks, _ = runs
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
    world_size, blocks, _ = runs
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
    _, _, rules = runs
    for result in rules:
        for name, message in result["rejected"].items():
            assert message is not None, f"{name} ran on a normalized-dimension shard"
            assert "sharded on dimension 1, the dimension it normalizes over" in message, message
            assert f"normtools.{name.split()[0]}" in message
        assert "QKNormParallel" in result["rejected"]["qk_norm per_layer"]


def test_per_head_qk_norm_runs_on_head_shards(runs):
    """per_head QK-Norm of q and k sharded by whole heads equals one process, forward and
    backward; its output stays sharded and the shared weight's gradient is a Partial sum."""
    _, _, rules = runs
    for result in rules:
        assert result["per_head_error"] <= 1e-5
        out_placements, grad_placements = result["per_head_placements"]
        assert str(out_placements) == "(Shard(dim=1),)"
        assert str(grad_placements) in ("(Partial(sum),)", "(Replicate(),)")
