"""normtools under PyTorch's DTensor tensor parallelism (``torch.distributed.tensor``).

Sharding rules. Every custom op of the library (``normtools::rms_norm_fwd`` / ``_bwd``, which
also carry ``add_rms_norm``; ``normtools::layer_norm_fwd`` / ``_bwd``; ``normtools::qk_norm_fwd``
/ ``_bwd``) gets a DTensor sharding rule (``register_sharding``), registered when this module is
imported. A row's statistic r = rsqrt(mean(x², -1) + eps) (and LayerNorm's mean) reads one row,
so on a mesh dimension where the input is

* replicated: everything is replicated;
* sharded on a dimension d other than the normalized one (batch, sequence: what
  ``SequenceParallel`` produces): each rank runs the op on its rows; the outputs and saved
  statistics are sharded on d, the weight and bias are replicated, and their gradients
  Σ_rows dy ⊙ x̂ (and Σ_rows dy) are ``Partial("sum")``: each rank sums its own rows, and DTensor
  adds the ranks' sums when the gradient is used (the replicated weight gets the single-device
  gradient);
* sharded on the normalized dimension: the local mean of squares would be the shard's, not the
  row's, so the rule raises ``NormalizedDimShardError`` instead of computing it (or gathering the
  rows without being asked).

QK-Norm's op sees q (T, Hq·D) and k (T, Hk·D). Sharding the token dimension is the case above.
Sharding the columns splits heads: with ``scope="per_head"`` a row is one head, so the op runs
locally when every rank holds whole heads (P divides Hq and Hk; a ``(H, D)`` weight is then
sharded by rows, a shared ``(D,)`` weight replicated with a ``Partial`` gradient); with
``scope="per_layer"`` the row is the whole projection, which is the normalized-dimension case:
use ``QKNormParallel``.

``QKNormParallel``. A ``ParallelStyle`` for a ``normtools.QKNorm`` behind column-parallel q/k
projections (``ColwiseParallel``): it runs ``normtools.core.tp.qk_norm`` on the local shards,
which for ``per_layer`` all-reduces only the per-token float32 sums of squares of q and k, one
(T, 2) all-reduce forward and one backward, and never gathers q or k. k heads fewer than the
ranks (GQA) are replicated as in ``normtools.core.tp``: rank j normalizes the copy of head
``head_range(Hk, P, j)``.
"""

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

import normtools.core.ops  # noqa: F401  (defines torch.ops.normtools.rms_norm_*, layer_norm_*)
from normtools.core import tp
from normtools.core.qk import QKNorm   # (defines torch.ops.normtools.qk_norm_*)

__all__ = ["NormalizedDimShardError", "QKNormParallel"]

_ops = torch.ops.normtools
_R = Replicate()


class NormalizedDimShardError(ValueError):
    """A normtools op got a DTensor sharded on the dimension it normalizes over (DTensor's
    dispatcher reports it as a RuntimeError carrying this message)."""


def _shard_dims(spec):
    """The tensor dimensions that ``spec`` shards, over all mesh dimensions."""
    return {p.dim for p in spec.placements if isinstance(p, (Shard, _StridedShard))}


def _reject_normalized_shard(op_name, spec, normalized_dim, remedy):
    """Raise ``NormalizedDimShardError`` if ``spec`` shards ``normalized_dim``."""
    if spec is not None and normalized_dim in {d % spec.ndim for d in _shard_dims(spec)}:
        raise NormalizedDimShardError(
            f"{op_name}: the input DTensor {tuple(spec.shape)} is sharded on dimension "
            f"{normalized_dim}, the dimension it normalizes over (placements "
            f"{spec.placements}); each rank would compute its shard's statistic instead of the "
            f"row's. {remedy}")


_ROW_REMEDY = ("Shard a non-normalized dimension (batch, sequence: SequenceParallel) or "
               "redistribute to Replicate() first.")


def _row_strategies(ndim, tensors):
    """[(outputs, inputs)] for a row op: all replicated, or sharded on each non-normalized dim.

    ``tensors`` gives, output slots then input slots, what each one is: "row" (a tensor of the
    input's shape, or its (..., 1) statistic), "param" (a replicated weight / bias), "grad" (a
    parameter's gradient), "empty" (an empty placeholder output) or None (absent, not a tensor).
    """
    def placements(shard):
        chosen = {"row": shard, "param": _R, "empty": _R, None: None,
                  "grad": _R if shard == _R else Partial("sum")}
        return [chosen[kind] for kind in tensors]
    return [placements(_R)] + [placements(Shard(d)) for d in range(ndim - 1)]


def _split(strategies, n_out):
    return [(s[:n_out], s[n_out:]) for s in strategies]


@register_sharding(_ops.rms_norm_fwd.default)
def _rms_norm_fwd_sharding(x, residual, weight, eps, offset, casting, backend):
    op_name = "normtools.rms_norm" if residual is None else "normtools.add_rms_norm"
    _reject_normalized_shard(op_name, x, x.ndim - 1, _ROW_REMEDY)
    kinds = ["row", "row" if residual is not None else "empty", "row",       # y, summed, rstd
             "row", "row" if residual is not None else None, "param" if weight is not None else None,
             None, None, None, None]
    return _split(_row_strategies(x.ndim, kinds), 3)


@register_sharding(_ops.rms_norm_bwd.default)
def _rms_norm_bwd_sharding(dy, x, weight, rstd, dsum, offset, backend):
    _reject_normalized_shard("normtools.rms_norm (backward)", x, x.ndim - 1, _ROW_REMEDY)
    kinds = ["row", "grad" if weight is not None else "empty",                 # dx, dw
             "row", "row", "param" if weight is not None else None, "row",
             "row" if dsum is not None else None, None, None]
    return _split(_row_strategies(x.ndim, kinds), 2)


@register_sharding(_ops.layer_norm_fwd.default)
def _layer_norm_fwd_sharding(x, weight, bias, eps, backend):
    _reject_normalized_shard("normtools.layer_norm", x, x.ndim - 1, _ROW_REMEDY)
    kinds = ["row", "row", "row",                                               # y, mean, rstd
             "row", "param" if weight is not None else None,
             "param" if bias is not None else None, None, None]
    return _split(_row_strategies(x.ndim, kinds), 3)


@register_sharding(_ops.layer_norm_bwd.default)
def _layer_norm_bwd_sharding(dy, x, weight, bias, mean, rstd, backend):
    _reject_normalized_shard("normtools.layer_norm (backward)", x, x.ndim - 1, _ROW_REMEDY)
    kinds = ["row", "grad" if weight is not None else "empty",                  # dx, dw, db
             "grad" if bias is not None else "empty",
             "row", "row", "param" if weight is not None else None,
             "param" if bias is not None else None, "row", "row", None]
    return _split(_row_strategies(x.ndim, kinds), 3)


# ----------------------------------------------------------------------------- QK-Norm

_PER_LAYER_REMEDY = ("A per_layer QK-Norm behind column-parallel projections needs the "
                     "per-token all-reduce: parallelize the QKNorm module with "
                     "normtools.tp.QKNormParallel.")


def _qk_strategies(op_name, q, k, q_weight, k_weight, head_dim, per_layer):
    """[(q-side outputs, q-side weight gradient...)] pieces for the QK-Norm ops: returns the
    placements of (q-like, k-like, rstd, q_weight, k_weight, q_weight grad, k_weight grad) per
    strategy. q, k are (T, H·D); the saved inverse RMS is (H_rows, T)."""
    for spec in (q, k):
        if 1 in {d % 2 for d in _shard_dims(spec)}:
            if per_layer:
                _reject_normalized_shard(op_name, spec, 1, _PER_LAYER_REMEDY)
            for mesh_dim, p in enumerate(spec.placements):
                heads = spec.shape[1] // head_dim
                if isinstance(p, (Shard, _StridedShard)) and p.dim % 2 == 1 and (
                        isinstance(p, _StridedShard) or heads % spec.mesh.size(mesh_dim)):
                    raise NormalizedDimShardError(
                        f"{op_name}: {heads} heads of {head_dim} columns cannot be split evenly "
                        f"over {spec.mesh.size(mesh_dim)} ranks (placements {spec.placements}): "
                        f"a rank would hold part of a head, the dimension a per_head QK-Norm "
                        f"normalizes over. Keep this projection Replicate() or use "
                        f"normtools.tp.QKNormParallel, which replicates k heads as vLLM does.")
    tokens = (Shard(0), Shard(0), Shard(1), _R, _R, Partial("sum"), Partial("sum"))
    replicated = (_R,) * 7
    strategies = [replicated, tokens]
    if not per_layer:
        def weight(w):     # (H, D) rows follow the heads; a shared (D,) row is replicated
            return (Shard(0), Shard(0)) if w.ndim == 2 else (_R, Partial("sum"))
        (qw, dqw), (kw, dkw) = weight(q_weight), weight(k_weight)
        strategies.append((Shard(1), Shard(1), Shard(0), qw, kw, dqw, dkw))
    return strategies


@register_sharding(_ops.qk_norm_fwd.default)
def _qk_norm_fwd_sharding(q, k, q_weight, k_weight, head_dim, per_layer, eps, offset, casting,
                          backend):
    result = []
    for qp, kp, rstd, qw, kw, _, _ in _qk_strategies(
            "normtools.qk_norm", q, k, q_weight, k_weight, head_dim, per_layer):
        # outputs (qy, ky, q_rstd, k_rstd); inputs (q, k, q_weight, k_weight, 6 non-tensors)
        result.append(([qp, kp, rstd, rstd], [qp, kp, qw, kw] + [None] * 6))
    return result


@register_sharding(_ops.qk_norm_bwd.default)
def _qk_norm_bwd_sharding(dqy, dky, q, k, q_weight, k_weight, q_rstd, k_rstd, head_dim,
                          per_layer, offset, backend):
    result = []
    for qp, kp, rstd, qw, kw, dqw, dkw in _qk_strategies(
            "normtools.qk_norm (backward)", q, k, q_weight, k_weight, head_dim, per_layer):
        # outputs (dq, dk, dq_weight, dk_weight); inputs (dqy, dky, q, k, weights, rstds, 4 more)
        result.append(([qp, kp, dqw, dkw], [qp, kp, qp, kp, qw, kw, rstd, rstd] + [None] * 4))
    return result


# ----------------------------------------------------------------------------- the style

class QKNormParallel(ParallelStyle):
    """Parallelize a ``normtools.QKNorm`` that follows column-parallel q and k projections.

    ``forward(q, k)`` takes this rank's columns of q and k: local tensors (what
    ``ColwiseParallel()`` returns by default) or DTensors sharded on the last dimension. k may
    instead be a replicated DTensor when it has fewer heads than the mesh has ranks (GQA with
    replicated k heads); rank j then keeps the copy of head ``head_range(Hk, P, j)``. It returns
    this rank's normalized columns as local tensors, as ``ColwiseParallel`` does.

    The weights become DTensors: sharded by heads (``Shard(0)``) where every rank holds whole
    heads of its own, replicated otherwise (a shared ``(head_dim,)`` weight, or a tensor with
    fewer heads than ranks), the replicated ones with a ``Partial("sum")`` gradient that adds the
    ranks' (and the head copies') contributions. Head counts the ranks cannot hold whole (H ≥ P
    not a multiple of P, H < P not a divisor of P) raise a ValueError when the module is
    parallelized, before any weight is distributed. per_layer runs ``normtools.core.tp.qk_norm``:
    one all-reduce of the per-token sums of squares (q and k together, (T, 2) float32) forward
    and one of the per-token Σ g·x̂ backward; per_head runs the single-device op on the shards.
    """

    def _apply(self, module, device_mesh):
        if not isinstance(module, QKNorm):
            raise TypeError(f"QKNormParallel parallelizes a normtools.QKNorm, got "
                            f"{type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(f"QKNormParallel needs a 1-D tensor-parallel mesh, got "
                             f"{device_mesh.ndim} dimensions")
        world_size = device_mesh.size()
        placements = {}
        for name in ("q_weight", "k_weight"):   # check both before distributing either
            weight = getattr(module, name)
            heads = None if weight.shape == (module.head_dim,) else (
                weight.shape[0] if weight.dim() == 2 else weight.numel() // module.head_dim)
            try:
                tp.head_range(heads or world_size, world_size, 0)
            except ValueError as error:
                raise ValueError(
                    f"QKNormParallel: {name} {tuple(weight.shape)} has {heads} heads of "
                    f"{module.head_dim} columns, which {world_size} ranks cannot hold whole "
                    f"({error}): heads at least as many as the ranks must be a multiple of "
                    f"them, fewer heads must divide them (each head replicated on P / H "
                    f"ranks)") from error
            placements[name] = Shard(0) if heads is not None and heads >= world_size else _R
        for name, placement in placements.items():
            module.register_parameter(name, torch.nn.Parameter(
                distribute_tensor(getattr(module, name).detach(), device_mesh, [placement])))
        mesh = device_mesh

        def forward(q, k):
            rank, group = mesh.get_local_rank(), mesh.get_group()
            q_local, k_local = (_local_columns(x, mesh, rank, module.head_dim) for x in (q, k))
            q_weight, k_weight = (_local_weight(w, module.head_dim, world_size, rank)
                                  for w in (module.q_weight, module.k_weight))
            return tp.qk_norm(q_local, k_local, q_weight, k_weight, module.eps,
                              head_dim=module.head_dim, scope=module.scope, group=group,
                              offset=module.offset, casting=module.casting,
                              backend=module.backend)

        module.forward = forward
        return module


def _local_columns(x, mesh, rank, head_dim):
    """This rank's columns of a q or k input: the local tensor of a plain tensor or a
    last-dimension shard; the rank's head of a replicated DTensor with fewer heads than ranks."""
    if not isinstance(x, DTensor):
        return x
    if x.placements == (_R,):
        heads = x.shape[-1] // head_dim
        if heads >= mesh.size():
            raise ValueError(f"a replicated input with {heads} heads on {mesh.size()} ranks: "
                             f"shard it on the last dimension (ColwiseParallel)")
        return tp.shard_columns(x.to_local(grad_placements=[Partial()]), head_dim=head_dim,
                                num_heads=heads, world_size=mesh.size(), rank=rank)
    if x.placements != (Shard(x.ndim - 1),) and x.placements != (Shard(-1),):
        raise NormalizedDimShardError(
            f"QKNormParallel takes q/k sharded on the last dimension (ColwiseParallel), got "
            f"placements {x.placements}")
    return x.to_local()


def _local_weight(weight, head_dim, world_size, rank):
    """The slice of a QK-Norm weight DTensor that this rank multiplies by: its shard, or, for a
    replicated one, ``tp.shard_weight`` of the whole (its gradient Partial: ranks add up)."""
    if weight.placements != (_R,):
        return weight.to_local()
    whole = weight.to_local(grad_placements=[Partial()])
    heads = None if whole.shape == (head_dim,) else (
        whole.shape[0] if whole.dim() == 2 else whole.numel() // head_dim)
    return tp.shard_weight(whole, head_dim=head_dim, num_heads=heads or world_size,
                           world_size=world_size, rank=rank)
