"""Per-layer QK-Norm under tensor parallelism done wrong: each rank normalizes its own column
shard with the shard's mean square instead of the token's (chapter 3's demonstration;
``normtools.core.tp.qk_norm`` is the right version, with one all-reduce).
"""

from normtools.core import qk, tp


def naive_tp_qk_norm(q, k, q_weight, k_weight, eps=1e-6, *, head_dim, world_size, offset=0.0,
                     casting="llama"):
    """Per-layer QK-Norm as P = ``world_size`` ranks would compute it without communication.

    q (T, Hq·head_dim), k (T, Hk·head_dim) and the per-layer weights are split by heads as a
    column-parallel projection splits them (``normtools.core.tp.shard_columns``/``shard_weight``);
    each rank j normalizes its shard x_j on its own,

        y_j = (offset + w_j) · x_j · rsqrt(mean(x_j²) + eps),

    and the shards are put back together (``tp.unshard_columns``). Returns (q_naive, k_naive),
    to compare with the single-device ``normtools.qk_norm(..., scope="per_layer")``.
    """
    qk.check_qk_inputs(q, k, q_weight, k_weight, eps, head_dim, "per_layer", offset, casting, "torch")
    if q.dim() != 2 or k.dim() != 2:
        raise ValueError(f"q and k must be (tokens, H*head_dim), got {tuple(q.shape)} and {tuple(k.shape)}")
    heads = {"q": q.shape[-1] // head_dim, "k": k.shape[-1] // head_dim}
    pieces = {"q": [], "k": []}
    for rank in range(world_size):
        cut = dict(head_dim=head_dim, world_size=world_size, rank=rank)
        q_j = tp.shard_columns(q, num_heads=heads["q"], **cut)
        k_j = tp.shard_columns(k, num_heads=heads["k"], **cut)
        wq_j = tp.shard_weight(q_weight, num_heads=heads["q"], **cut)
        wk_j = tp.shard_weight(k_weight, num_heads=heads["k"], **cut)
        q_out, k_out = qk.qk_norm(q_j, k_j, wq_j, wk_j, eps, head_dim=head_dim, scope="per_layer",
                                  offset=offset, casting=casting, backend="torch")
        pieces["q"].append(q_out)
        pieces["k"].append(k_out)
    return tuple(tp.unshard_columns(pieces[name], head_dim=head_dim, num_heads=heads[name],
                                    world_size=world_size) for name in ("q", "k"))
