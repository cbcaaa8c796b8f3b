"""normtools norms inside DTensor tensor-parallel Transformer blocks, checked against one process.

Two tiny blocks with normtools norms: ``LlamaBlock`` (pre-norm RMSNorm, attention, SwiGLU MLP)
and ``Olmo2Block`` (norms on the attention and MLP outputs, per-layer QK-Norm of q and k).
``PLANS`` gives their ``parallelize_module`` plans in torchtitan's shape: column-parallel
q/k/v and MLP inputs, row-parallel o and down projections, sequence-parallel norms. For OLMo 2
there are two ways to run the per-layer QK-Norm:

* "allreduce": q/k stay column-parallel and ``QKNormParallel`` all-reduces the per-token sums
  of squares (normtools);
* "gather": transformers' plan for OLMo 2, ``colwise_gather_output`` on q, k and v (the
  projections' outputs are all-gathered, so the norm and attention run on all heads on every
  rank) and ``rowwise_split_input`` on o.

``run_block`` (a worker for ``measure.distributed.spawn``) runs a block forward and backward
under a plan and returns its errors against the single-process block and the bytes the rank
received; ``qk_path_bytes_per_token`` is the formula for the bytes in which the two OLMo 2
plans differ.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from normtools.core.modules import RMSNorm
from normtools.core.qk import QKNorm
from normtools.core.tp_dtensor import QKNormParallel
from normtools.measure.distributed import CommBytes

__all__ = ["LlamaBlock", "Olmo2Block", "PLANS", "run_block", "qk_path_bytes_per_token"]


class _Attention(nn.Module):
    """Causal attention; the number of local heads is read from the projections' outputs, so
    the same code runs whole or column-parallel (torchtitan's ``view(B, S, -1, D)``)."""

    def __init__(self, dim, num_heads, num_kv_heads, qk_norm=None):
        super().__init__()
        self.head_dim = dim // num_heads
        self.wq = nn.Linear(dim, num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(num_heads * self.head_dim, dim, bias=False)
        self.qk_norm = qk_norm

    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        batch, seq = q.shape[:2]
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class _MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """h = x + attn(norm1(x)); out = h + mlp(norm2(h))."""

    def __init__(self, dim=32, num_heads=8, num_kv_heads=4, hidden=64):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention = _Attention(dim, num_heads, num_kv_heads)
        self.feed_forward = _MLP(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Olmo2Block(nn.Module):
    """h = x + norm1(attn(x)); out = h + norm2(mlp(h)), with per-layer QK-Norm in attn."""

    def __init__(self, dim=32, num_heads=8, num_kv_heads=4, hidden=64):
        super().__init__()
        qk_norm = QKNorm(dim // num_heads, num_heads, num_kv_heads, scope="per_layer")
        self.attention = _Attention(dim, num_heads, num_kv_heads, qk_norm)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.feed_forward = _MLP(dim, hidden)

    def forward(self, x):
        h = x + self.attention_norm(self.attention(x))
        return h + self.ffn_norm(self.feed_forward(h))


def _sequence_parallel_plan(pre_norm):
    """torchtitan's plan for one block: the residual stream sharded on the sequence (Shard(1),
    local tensors), gathered before the column-parallel projections and reduce-scattered after
    the row-parallel ones. A pre-norm's sequence-sharded DTensor output goes into that gather;
    a post-norm's output is added to the local residual stream, so it returns a local tensor."""
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    norm = SequenceParallel(use_local_output=not pre_norm)
    return {"attention_norm": norm, "ffn_norm": norm, "attention": gather, "feed_forward": gather,
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}


def _olmo2_plan(qk):
    plan = _sequence_parallel_plan(pre_norm=False)
    if qk == "allreduce":
        plan["attention.qk_norm"] = QKNormParallel()
    else:   # transformers' colwise_gather_output / rowwise_split_input
        for name in ("wq", "wk", "wv"):
            plan[f"attention.{name}"] = ColwiseParallel(output_layouts=Replicate())
        plan["attention.wo"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    return plan


PLANS = {"llama": (LlamaBlock, lambda: _sequence_parallel_plan(pre_norm=True)),
         "olmo2_allreduce": (Olmo2Block, lambda: _olmo2_plan("allreduce")),
         "olmo2_gather": (Olmo2Block, lambda: _olmo2_plan("gather"))}


def _set_backend(block, backend):
    for module in block.modules():
        if isinstance(module, (RMSNorm, QKNorm)):
            module.backend = backend


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_block(rank, world_size, name, *, backend="auto", batch=2, seq=8, seed=0, **sizes):
    """Per-rank worker: the ``PLANS[name]`` block (``sizes``: dim, num_heads, num_kv_heads,
    hidden) forward and backward, whole in this process and parallelized over all ranks.

    Returns the max abs differences of the output, the input gradient and every weight
    gradient (by parameter name), the float32 scale of the output, and ``received``, the bytes
    this rank received in the parallel forward and backward (``CommBytes``)."""
    block_class, plan = PLANS[name]
    torch.manual_seed(seed)
    reference = block_class(**sizes)
    for p in reference.parameters():   # norms' weights off 1, so their gradients matter
        p.data.add_(0.1 * torch.randn_like(p))
    parallel = block_class(**sizes)
    parallel.load_state_dict(reference.state_dict())
    _set_backend(reference, backend)
    _set_backend(parallel, backend)
    x = torch.randn(batch, seq, reference.attention.wq.in_features)
    dy = torch.randn_like(x)

    x_ref = x.clone().requires_grad_()
    (reference(x_ref) * dy).sum().backward()

    mesh = init_device_mesh("cpu", (world_size,))
    parallelize_module(parallel, mesh, plan())
    rows = slice(rank * seq // world_size, (rank + 1) * seq // world_size)   # Shard(1)
    x_local = x[:, rows].clone().requires_grad_()
    with CommBytes() as comm:
        y_local = parallel(x_local)
        (y_local * dy[:, rows]).sum().backward()
    y = DTensor.from_local(y_local.detach(), mesh, [Shard(1)]).full_tensor()
    x_grad = DTensor.from_local(x_local.grad, mesh, [Shard(1)]).full_tensor()
    expected = dict(reference.named_parameters())
    errors = {"output": (y - reference(x)).abs().max().item(),
              "input_grad": (x_grad - x_ref.grad).abs().max().item()}
    for pname, p in parallel.named_parameters():
        errors[pname] = (_full(p.grad) - expected[pname].grad).abs().max().item()
    return {"errors": errors, "scale": x_ref.grad.abs().max().item(), "received": comm.received,
            "calls": comm.calls}


def qk_path_bytes_per_token(num_heads, num_kv_heads, head_dim, world_size, dtype_bytes):
    """Bytes one rank receives per token and per layer, forward and backward, where the two
    OLMo 2 plans differ (ring formulas of ``measure.distributed``, P = world_size):

    allreduce: forward one all-reduce of q's and k's float32 sums of squares (2 numbers per
    token), backward one of the per-token Σ g·x̂: 2 · 2(P − 1)/P · 2 · 4 bytes.
    gather: forward all-gathers of q, k and v, (Hq + 2 Hk) · D numbers; backward the row-parallel
    o projection's input gradient, replicated by ``rowwise_split_input``, is all-gathered,
    Hq · D numbers: (P − 1)/P · (Hq + 2 Hk + Hq) · D · dtype_bytes.
    """
    p = world_size
    return {"allreduce": 2 * (2 * (p - 1) / p * 2 * 4),
            "gather": (p - 1) / p * (2 * num_heads + 2 * num_kv_heads) * head_dim * dtype_bytes}
