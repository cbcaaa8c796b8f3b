"""Per-layer QK-Norm on column-parallel shards, run on gloo processes: the demonstration of
chapter 3 (each shard normalized on its own against ``normtools.core.tp.qk_norm``'s all-reduce).

``run_sharded_qk_norm`` is the per-rank worker (forward, backward, the naive output and the
number of collectives); ``demo_inputs`` / ``demo_errors`` build shards and score results;
``compare_naive_vs_allreduce`` does all three on ``spawn``.
"""

import torch

from normtools.core import qk, tp
from normtools.measure.distributed import CommBytes, spawn

__all__ = ["run_sharded_qk_norm", "demo_inputs", "demo_errors", "compare_naive_vs_allreduce"]


def run_sharded_qk_norm(rank, world_size, shards, device="cpu", **options):
    """Per-rank worker (for ``spawn``): TP QK-Norm forward and backward of ``shards[rank]``
    (on ``device``; "cuda" means this rank's GPU).

    A shard is a dict with q, k, q_weight, k_weight and the upstream gradients dq_out, dk_out;
    ``options`` go to ``qk_norm`` (head_dim, scope, eps, offset, casting, backend). Returns
    the outputs, the gradients of q, k and both weights, the naive output (each shard
    normalized on its own with the same scope), and ``collectives``, the number of
    torch.distributed collectives that the TP call (forward and backward) made.
    """
    device = f"cuda:{rank}" if device == "cuda" else device
    shard = {name: t.to(device) for name, t in shards[rank].items()}
    leaves = {name: shard[name].clone().requires_grad_()
              for name in ("q", "k", "q_weight", "k_weight")}
    with CommBytes() as comm:
        q_out, k_out = tp.qk_norm(leaves["q"], leaves["k"], leaves["q_weight"],
                                  leaves["k_weight"], **options)
        loss = (q_out.float() * shard["dq_out"]).sum() + (k_out.float() * shard["dk_out"]).sum()
        loss.backward()
    naive_q, naive_k = qk.qk_norm(shard["q"], shard["k"], shard["q_weight"], shard["k_weight"],
                                   **options)
    return {"q_out": q_out.detach(), "k_out": k_out.detach(), "naive_q_out": naive_q,
            "naive_k_out": naive_k, "collectives": len(comm.calls),
            **{f"d{name}": leaf.grad for name, leaf in leaves.items()}}


def _max_rel_err(actual, expected):
    return ((actual.double() - expected.double()).abs().max() /
            expected.double().abs().max()).item()


def demo_inputs(world_size, *, tokens=4, num_heads=8, num_kv_heads=2, head_dim=16, seed=0):
    """Random float32 per_layer q/k (T, H·D) and weights, cut into per-rank shards.

    Returns (shards, full): ``shards`` is the argument of ``run_sharded_qk_norm`` (zero
    upstream gradients), ``full`` the dict of whole tensors."""
    gen = torch.Generator().manual_seed(seed)
    full = {"q": torch.randn(tokens, num_heads * head_dim, generator=gen),
            "k": 3 * torch.randn(tokens, num_kv_heads * head_dim, generator=gen),
            "q_weight": 1 + 0.1 * torch.randn(num_heads * head_dim, generator=gen),
            "k_weight": 1 + 0.1 * torch.randn(num_kv_heads * head_dim, generator=gen)}
    shards = []
    for rank in range(world_size):
        cut = {"head_dim": head_dim, "world_size": world_size, "rank": rank}
        shard = {name: tp.shard_columns(full[name], num_heads=heads, **cut)
                 for name, heads in (("q", num_heads), ("k", num_kv_heads),
                                     ("q_weight", num_heads), ("k_weight", num_kv_heads))}
        shard["dq_out"] = torch.zeros_like(shard["q"])
        shard["dk_out"] = torch.zeros_like(shard["k"])
        shards.append(shard)
    return shards, full


def demo_errors(results, full, *, head_dim=16, eps=1e-6):
    """Max relative errors, against single-process per_layer QK-Norm of ``full``, of the naive
    (each shard on its own) and all-reduced outputs in ``results`` (from
    ``run_sharded_qk_norm`` on ``demo_inputs`` shards)."""
    world_size = len(results)
    refs = qk.qk_norm(full["q"], full["k"], full["q_weight"], full["k_weight"], eps,
                       head_dim=head_dim, scope="per_layer", backend="torch")
    errors = {}
    for method, key in (("naive", "naive_{}_out"), ("allreduce", "{}_out")):
        for name, ref in zip(("q", "k"), refs):
            whole = tp.unshard_columns([r[key.format(name)] for r in results], head_dim=head_dim,
                                    num_heads=ref.shape[-1] // head_dim, world_size=world_size)
            errors[f"{method}_{name}"] = _max_rel_err(whole, ref)
    return errors


def compare_naive_vs_allreduce(world_size=2, *, tokens=4, num_heads=8, num_kv_heads=2,
                               head_dim=16, eps=1e-6, seed=0):
    """Spawn ``world_size`` gloo processes, run per_layer QK-Norm on column-parallel shards of
    q and k, and return the max relative errors against the single-process result of the
    naive version (each shard normalized on its own) and of the all-reduced one:
    ``{"naive_q", "naive_k", "allreduce_q", "allreduce_k"}`` (float32)."""
    shards, full = demo_inputs(world_size, tokens=tokens, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim, seed=seed)
    results = spawn(run_sharded_qk_norm, world_size, shards, head_dim=head_dim,
                    scope="per_layer", eps=eps, backend="torch")
    return demo_errors(results, full, head_dim=head_dim, eps=eps)
