"""normtools.core.tp: QK-Norm of column-parallel q/k shards on 2 and 4 gloo processes.

One spawn per world size runs every case (process start-up dominates the cost). Each case is
checked against single-process ``normtools.qk_norm`` on the whole tensors, float32, max
relative error ≤ 1e-5: every rank's outputs, the q/k gradients and both weight gradients.
Replicated k heads (Hk < world size) get a different upstream gradient on each copy; the
single-process gradient then takes their sum, and so do the gathered shard gradients.
"""

import pytest
import torch

import normtools
from normtools.core import tp
from normtools.measure import distributed, tp_qk_norm

MAX_REL_ERR = 1e-5
HEAD_DIM = 8

# (name, scope, weight kind, Hq, Hk, casting, offset, headed layout)
CASES = {
    2: [("layer", "per_layer", "per_layer", 4, 2, "llama", 0.0, False),
        ("layer_replicated_k", "per_layer", "per_layer", 4, 1, "gemma", 1.0, True),
        ("head_shared", "per_head", "shared", 4, 2, "llama", 0.0, False),
        ("head_rows_replicated_k", "per_head", "per_head", 4, 1, "gemma", 0.5, True)],
    4: [("layer", "per_layer", "per_layer", 8, 4, "gemma", 0.0, False),
        ("layer_replicated_k_x2", "per_layer", "per_layer", 8, 2, "llama", 0.0, False),
        ("layer_replicated_k_x4", "per_layer", "per_layer", 4, 1, "gemma", 0.5, True),
        ("head_shared_replicated_k", "per_head", "shared", 4, 2, "llama", 0.0, True)],
}


def weight(kind, heads, offset, gen):
    shape = {"per_layer": (heads * HEAD_DIM,), "shared": (HEAD_DIM,),
             "per_head": (heads, HEAD_DIM)}[kind]
    return 0.5 - offset + torch.rand(shape, generator=gen)


def build_case(world_size, case, tokens=3, seed=0):
    """Whole tensors, the single-process reference (outputs and gradients) and the shards."""
    _, scope, kind, hq, hk, casting, offset, headed = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, hq * HEAD_DIM, generator=gen)
    k = 2 * torch.randn(tokens, hk * HEAD_DIM, generator=gen)
    q_weight, k_weight = weight(kind, hq, offset, gen), weight(kind, hk, offset, gen)
    dq_out = torch.randn(q.shape, generator=gen)
    # one upstream gradient per rank's copy of its k heads
    dk_out = [torch.randn(tokens, len(tp.head_range(hk, world_size, r)) * HEAD_DIM, generator=gen)
              for r in range(world_size)]
    options = dict(head_dim=HEAD_DIM, scope=scope, casting=casting, offset=offset)

    leaves = [t.clone().requires_grad_() for t in (q, k, q_weight, k_weight)]
    q_ref, k_ref = normtools.qk_norm(*leaves, **options, backend="torch")
    dk_total = tp.unshard_columns(dk_out, head_dim=HEAD_DIM, num_heads=hk, world_size=world_size,
                                  combine="sum")
    grads = torch.autograd.grad([q_ref, k_ref], leaves, [dq_out, dk_total])
    reference = dict(q_out=q_ref.detach(), k_out=k_ref.detach(),
                     **dict(zip(("dq", "dk", "dq_weight", "dk_weight"), grads)))

    shards = []
    for rank in range(world_size):
        cut = dict(head_dim=HEAD_DIM, world_size=world_size, rank=rank)
        shard = dict(q=tp.shard_columns(q, num_heads=hq, **cut),
                     k=tp.shard_columns(k, num_heads=hk, **cut),
                     q_weight=tp.shard_weight(q_weight, num_heads=hq, **cut),
                     k_weight=tp.shard_weight(k_weight, num_heads=hk, **cut),
                     dq_out=tp.shard_columns(dq_out, num_heads=hq, **cut), dk_out=dk_out[rank])
        if headed:
            for name in ("q", "k", "dq_out", "dk_out"):
                shard[name] = shard[name].unflatten(-1, (-1, HEAD_DIM))
        shards.append(shard)
    return shards, reference, options


def rel_err(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def gather_weight_grad(pieces, kind, heads, world_size):
    """Whole weight gradient from the ranks' gradients: a shared weight's is the sum over ranks;
    per-head rows and per_layer columns are gathered, replicated copies summed."""
    if kind == "shared":
        return torch.stack(pieces).sum(0)
    flat = [p.reshape(-1) for p in pieces]
    whole = tp.unshard_columns(flat, head_dim=HEAD_DIM, num_heads=heads, world_size=world_size,
                               combine="sum")
    return whole.view(heads, HEAD_DIM) if kind == "per_head" else whole


@pytest.fixture(scope="module", params=[2, 4])
def sharded_runs(request):
    """(world size, [(case, reference, per-rank results)], demo (results, full)) from one spawn."""
    world_size = request.param
    built = [build_case(world_size, case, seed=i) for i, case in enumerate(CASES[world_size])]
    calls = [(tp_qk_norm.run_sharded_qk_norm, (shards,), options) for shards, _, options in built]
    demo_shards, demo_full = tp_qk_norm.demo_inputs(world_size, num_heads=8, num_kv_heads=1)
    calls.append((tp_qk_norm.run_sharded_qk_norm, (demo_shards,),
                  dict(head_dim=16, scope="per_layer", backend="torch")))
    per_rank = distributed.spawn(distributed.run_all, world_size, calls)
    runs = [(case, reference, [per_rank[r][i] for r in range(world_size)])
            for i, (case, (_, reference, _)) in enumerate(zip(CASES[world_size], built))]
    demo = [per_rank[r][-1] for r in range(world_size)]
    return world_size, runs, (demo, demo_full)


def check_against_single_process(world_size, case, ref, results):
    """Every rank's outputs, and the gathered gradients, against the single-process ones."""
    name, scope, kind, hq, hk = case[:5]
    for rank, result in enumerate(results):
        cut = dict(head_dim=HEAD_DIM, world_size=world_size, rank=rank)
        for out, heads in (("q_out", hq), ("k_out", hk)):
            expected = tp.shard_columns(ref[out], num_heads=heads, **cut)
            err = rel_err(result[out].reshape(expected.shape), expected)
            assert err <= MAX_REL_ERR, f"{name} rank {rank} {out}: {err:.3g}"
    for grad, heads in (("dq", hq), ("dk", hk)):
        whole = tp.unshard_columns([r[grad].flatten(1) for r in results], head_dim=HEAD_DIM,
                                   num_heads=heads, world_size=world_size, combine="sum")
        assert rel_err(whole, ref[grad]) <= MAX_REL_ERR, f"{name} {grad}"
    for grad, heads in (("dq_weight", hq), ("dk_weight", hk)):
        whole = gather_weight_grad([r[grad] for r in results], kind, heads, world_size)
        assert rel_err(whole, ref[grad]) <= MAX_REL_ERR, f"{name} {grad}"


def test_sharded_equals_single_process(sharded_runs):
    world_size, runs, _ = sharded_runs
    for case, ref, results in runs:
        check_against_single_process(world_size, case, ref, results)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL tensor parallelism needs 2 GPUs")
def test_nccl_two_gpus():
    for case in CASES[2]:
        shards, ref, options = build_case(2, case)
        results = distributed.spawn(tp_qk_norm.run_sharded_qk_norm, 2, shards,
                                    dist_backend="nccl", device="cuda", **options)
        check_against_single_process(2, case, ref, results)


def test_collectives(sharded_runs):
    """per_head: no collective at all; per_layer: one all-reduce forward, one backward."""
    _, runs, _ = sharded_runs
    for (name, scope, *_), _, results in runs:
        expected = 2 if scope == "per_layer" else 0
        assert [r["collectives"] for r in results] == [expected] * len(results), name


def test_naive_per_shard_normalization_is_wrong(sharded_runs):
    """Normalizing each shard on its own gives a different per_layer result (the all-reduced
    one matches); per_head shards are independent, so there the two agree."""
    world_size, runs, (demo, demo_full) = sharded_runs
    errors = tp_qk_norm.demo_errors(demo, demo_full, head_dim=16)
    assert errors["allreduce_q"] <= MAX_REL_ERR and errors["allreduce_k"] <= MAX_REL_ERR
    assert errors["naive_q"] > 1e-2
    for (name, scope, *_), _, results in runs:
        for result in results:
            naive, correct = result["naive_q_out"], result["q_out"]
            if scope == "per_layer":
                assert rel_err(naive, correct) > 1e-2, name
            else:
                assert torch.equal(naive, correct), name


def test_sharding_helpers():
    assert [list(tp.head_range(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(tp.head_range(2, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]
    x = torch.arange(2 * 2 * 3).view(2, 6)
    pieces = [tp.shard_columns(x, head_dim=3, num_heads=2, world_size=4, rank=r) for r in range(4)]
    assert torch.equal(pieces[1], x[:, :3]) and torch.equal(pieces[2], x[:, 3:6])
    assert torch.equal(tp.unshard_columns(pieces, head_dim=3, num_heads=2, world_size=4), x)
    assert torch.equal(tp.unshard_columns(pieces, head_dim=3, num_heads=2, world_size=4,
                                          combine="sum"), 2 * x)
    rows = torch.arange(12.).view(4, 3)
    assert torch.equal(tp.shard_weight(rows, head_dim=3, num_heads=4, world_size=2, rank=1),
                       rows[2:])
    shared = torch.ones(3)
    assert tp.shard_weight(shared, head_dim=3, num_heads=4, world_size=2, rank=1) is shared
    for heads, world in ((6, 4), (3, 4)):
        with pytest.raises(ValueError):
            tp.head_range(heads, world, 0)
    with pytest.raises(ValueError):
        tp.head_range(4, 2, 2)


def test_per_layer_needs_a_process_group():
    q, k, w = torch.randn(2, 16), torch.randn(2, 16), torch.ones(16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        tp.qk_norm(q, k, w, w, head_dim=8, scope="per_layer")
    # per_head needs none
    torch.testing.assert_close(tp.qk_norm(q, k, w[:8], w[:8], head_dim=8, scope="per_head")[0],
                               normtools.qk_norm(q, k, w[:8], w[:8], head_dim=8)[0])
