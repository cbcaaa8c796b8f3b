"""QK-Norm under tensor parallelism (``torch.distributed``: gloo on CPU, NCCL on GPU).

Setting. The q and k projections are column-parallel: with P ranks, rank j holds the q heads
``head_range(Hq, P, j)`` and the k heads ``head_range(Hk, P, j)``, i.e. the columns
``[h0·D, h1·D)`` of the projection outputs (D = head_dim). When Hk < P the k heads are
*replicated*: P/Hk consecutive ranks hold a copy of the same head (as vLLM does for GQA).

per_head. Each head's statistics live inside one rank, so ``qk_norm(..., scope="per_head")`` is
the single-device op on the shard, with the shared ``(D,)`` weight or the rank's rows of an
``(H, D)`` weight. No communication.

per_layer. The statistics of a token cover the whole projection, N = H·D, which is split over
the ranks, so normalizing each shard on its own (the *naive* version) is wrong: it uses the
rank's mean of squares instead of the token's. Let rank j hold n = N/P columns (or, replicated,
n = D columns of one of the Hk heads) x_j of a token, and let M = P·n.

Forward. Each rank computes its float32 sum of squares σ_j = Σ_{i∈j} x_i², and one all-reduce
(of the (T, 2) tensor holding q's and k's sums together) gives S = Σ_j σ_j. Then

    r = rsqrt(S / M + eps),   y_j = (offset + w_j) · x_j · r     (with the casting conventions)

using only the local weight slice w_j. Why M = P·n: without replication M = N and S / M is the
mean of squares. With replication each of the Hk heads sits on R = P/Hk ranks, so S counts every
head R times, S = R·Σ_{i<N} x_i², while M = P·D = R·Hk·D = R·N: the factor R cancels. (This is
vLLM's "all-reduce the per-rank means, divide by P": S/M = (1/P)·Σ_j σ_j/n.)

Backward. With x̂ = x·r, s = offset + w and g = dy ⊙ s, the single-device gradient is

    dx = r · (g − x̂ · (1/N) Σ_{i<N} g_i x̂_i),     dw = Σ_tokens dy ⊙ x̂.

The sum over i again spans all ranks: a second all-reduce, of the per-token C = Σ_j Σ_{i∈j}
g_i x̂_i (q and k together), after which rank j forms dx_j = r · (g_j − x̂_j · C / M) locally.
The weight gradient needs no communication: column i of w only meets column i of x.

With replication, the R copies of a k head are used separately downstream (each rank's
attention reads its own copy), so the single-device computation they stand for receives the
upstream gradient G = Σ_copies dy_copy, and the gradient of the true k (or of its weight
slice) is the sum of the copies' gradients. C adds every copy's g·x̂ once, which is exactly
Σ_{i<N} (G ⊙ s)_i x̂_i, the sum the single-device formula needs; and summing
dx_j = r · (g_j − x̂_j · C/(R·N)) over the R copies gives r · (G ⊙ s − x̂ · C/N), the
single-device dx. Likewise the weight gradients of the copies add up to the single-device one
(what a trainer does for any replicated parameter). ``unshard_columns(..., combine="sum")``
performs these sums when checking against one process.

Running it: ``normtools.measure.distributed.spawn`` starts P gloo processes;
``normtools.measure.tp_qk_norm`` holds the naive-versus-all-reduce demonstration. Under
PyTorch's DTensor engine, ``normtools.core.tp_dtensor.QKNormParallel`` calls ``qk_norm``.
"""

import torch
import torch.distributed as dist

from normtools.core import qk as _qk
from normtools.core.launcher import as_rows
from normtools.core.ops import once_differentiable_norm
from normtools.core.reference import rms_norm_apply

__all__ = [
    "head_range",
    "shard_weight",
    "shard_columns",
    "unshard_columns",
    "qk_norm",
]


# ----------------------------------------------------------------------------- sharding

def head_range(num_heads, world_size, rank):
    """The heads that rank ``rank`` of ``world_size`` holds after a column-parallel projection.

    H ≥ P: the contiguous block of H/P heads (P must divide H). H < P: one head, replicated on
    P/H consecutive ranks (H must divide P).
    """
    for name, count in (("num_heads", num_heads), ("world_size", world_size)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{name} must be a positive integer, got {count!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    if num_heads >= world_size:
        if num_heads % world_size:
            raise ValueError(f"{num_heads} heads cannot be split over {world_size} ranks")
        per_rank = num_heads // world_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if world_size % num_heads:
        raise ValueError(f"{num_heads} heads cannot be replicated evenly over {world_size} ranks")
    head = rank * num_heads // world_size
    return range(head, head + 1)


def shard_columns(x, *, head_dim, num_heads, world_size, rank):
    """The columns of a (..., H·head_dim) tensor (a projection output, a per_layer weight)
    that belong to the heads of ``rank``; the last dimension must be ``num_heads · head_dim``."""
    if x.shape[-1] != num_heads * head_dim:
        raise ValueError(f"last dimension {x.shape[-1]} is not num_heads · head_dim = "
                         f"{num_heads} · {head_dim} = {num_heads * head_dim}")
    heads = head_range(num_heads, world_size, rank)
    return x[..., heads.start * head_dim:heads.stop * head_dim]


def shard_weight(weight, *, head_dim, num_heads, world_size, rank):
    """The slice of a QK-Norm weight that ``rank`` uses: the rows of its heads of an (H, D)
    weight, the columns of its heads of a per_layer (H·D,) weight, or the shared (D,) weight
    itself (every rank uses all of it)."""
    if weight.dim() == 2:
        heads = head_range(num_heads, world_size, rank)
        return weight[heads.start:heads.stop]
    if weight.shape == (head_dim,):
        return weight
    return shard_columns(weight, head_dim=head_dim, num_heads=num_heads, world_size=world_size,
                         rank=rank)


def unshard_columns(pieces, *, head_dim, num_heads, world_size, combine="first"):
    """Inverse of ``shard_columns`` over the per-rank ``pieces`` (ordered by rank).

    Replicated heads (H < P) appear on several ranks: ``combine="first"`` takes one copy (for
    forward outputs, identical on all copies), ``combine="sum"`` adds the copies (for the
    gradients of replicated tensors and weights, see the module docstring).
    """
    if combine not in ("first", "sum"):
        raise ValueError(f"combine must be 'first' or 'sum', got {combine!r}")
    blocks = {}
    for rank, piece in enumerate(pieces):
        start = head_range(num_heads, world_size, rank).start
        if start not in blocks:
            blocks[start] = piece
        elif combine == "sum":
            blocks[start] = blocks[start] + piece
    return torch.cat([blocks[start] for start in sorted(blocks)], dim=-1)


# ----------------------------------------------------------------------------- per_layer op

def _all_reduce_per_token(q_part, k_part, group):
    """One all-reduce (sum) of two per-token float32 vectors, q's and k's stacked as (T, 2)."""
    both = torch.stack([q_part, k_part], dim=-1)
    dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
    return both[:, :1], both[:, 1:]


class _PerLayerQKNorm(torch.autograd.Function):
    """Sharded per_layer QK-Norm of q (T, nq) and k (T, nk); math in the module docstring."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps, offset, casting, group):
        world_size = dist.get_world_size(group)
        q32, k32 = q.to(torch.float32), k.to(torch.float32)
        q_sum_sq, k_sum_sq = _all_reduce_per_token(q32.pow(2).sum(-1), k32.pow(2).sum(-1), group)
        q_rstd = torch.rsqrt(q_sum_sq / (world_size * q.shape[-1]) + eps)
        k_rstd = torch.rsqrt(k_sum_sq / (world_size * k.shape[-1]) + eps)
        ctx.save_for_backward(q, k, q_weight, k_weight, q_rstd, k_rstd)
        ctx.offset, ctx.group, ctx.world_size = offset, group, world_size
        return (rms_norm_apply(q, q_rstd, q_weight, offset, casting),
                rms_norm_apply(k, k_rstd, k_weight, offset, casting))

    @staticmethod
    @once_differentiable_norm("tp.qk_norm")
    def backward(ctx, dqy, dky):
        q, k, q_weight, k_weight, q_rstd, k_rstd = ctx.saved_tensors
        q_terms = _backward_terms(q, q_weight, q_rstd, dqy, ctx.offset)
        k_terms = _backward_terms(k, k_weight, k_rstd, dky, ctx.offset)
        # second all-reduce: C = Σ over all ranks' columns of g·x̂, per token, q and k together
        q_c, k_c = _all_reduce_per_token((q_terms[1] * q_terms[2]).sum(-1),
                                         (k_terms[1] * k_terms[2]).sum(-1), ctx.group)
        dq, dq_weight = _local_grads(q, q_weight, q_rstd, *q_terms, q_c, ctx.world_size)
        dk, dk_weight = _local_grads(k, k_weight, k_rstd, *k_terms, k_c, ctx.world_size)
        return dq, dk, dq_weight, dk_weight, None, None, None, None


def _backward_terms(x, weight, rstd, dy, offset):
    """(dy, x̂, g = dy ⊙ (offset + w)) in float32 for one sharded tensor."""
    dy = torch.zeros_like(x, dtype=torch.float32) if dy is None else dy.to(torch.float32)
    return dy, x.to(torch.float32) * rstd, dy * (offset + weight.to(torch.float32))


def _local_grads(x, weight, rstd, dy, x_hat, g, c, world_size):
    """dx = r · (g − x̂ · C / M) with M = P · n, and dw = Σ_tokens dy ⊙ x̂ (local)."""
    dx = rstd * (g - x_hat * c / (world_size * x.shape[-1]))
    return dx.to(x.dtype), (dy * x_hat).sum(0).to(weight.dtype)


def qk_norm(q_shard, k_shard, q_weight_shard, k_weight_shard, eps=1e-6, *, head_dim, scope,
            group=None, offset=0.0, casting="llama", backend="auto"):
    """QK-Norm of this rank's shards of q and k (column-parallel projections).

    per_head: the single-device ``normtools.qk_norm`` on the shard, no communication (backend
    as there). per_layer: local float32 sums of squares, one all-reduce over ``group`` for q
    and k together, scaling with the local weight slices; the backward does one more
    all-reduce (per-token Σ g·x̂). This path is plain PyTorch around the collectives; the
    module docstring derives it, replicated k heads included. Shapes as ``normtools.qk_norm``
    with the local heads; returns (q_normed, k_normed) shards.
    """
    headed, _, _ = _qk.check_qk_inputs(q_shard, k_shard, q_weight_shard, k_weight_shard, eps,
                                       head_dim, scope, offset, casting, backend)
    if scope == "per_head":
        return _qk.qk_norm(q_shard, k_shard, q_weight_shard, k_weight_shard, eps,
                           head_dim=head_dim, scope=scope, offset=offset, casting=casting,
                           backend=backend)
    if not dist.is_initialized():
        raise RuntimeError("per_layer tensor-parallel QK-Norm needs torch.distributed to be "
                           "initialized (dist.init_process_group)")
    q2d = as_rows(q_shard.flatten(-2) if headed else q_shard)
    k2d = as_rows(k_shard.flatten(-2) if headed else k_shard)
    qy, ky = _PerLayerQKNorm.apply(q2d, k2d, q_weight_shard, k_weight_shard, float(eps),
                                   float(offset), casting, group)
    return qy.view(q_shard.shape), ky.view(k_shard.shape)
