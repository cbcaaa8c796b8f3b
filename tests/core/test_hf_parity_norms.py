"""backend="torch" reproduces the Hugging Face transformers RMSNorm modules bit for bit.

Each family's module from the installed transformers is run on the same input and weight, in
float32 and bfloat16 (with float32 and same-dtype weights), and compared with ``torch.equal``.
"""

import pytest
import torch
from _oracle import make_input
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import normtools
from normtools.core.reference import rms_norm_native, rms_norm_reference

# (HF module, offset, casting) as the issue and normtools.core.reference document them
FAMILIES = {
    "llama": (LlamaRMSNorm, 0.0, "llama"),
    "qwen3": (Qwen3RMSNorm, 0.0, "llama"),
    "minimax_m2": (MiniMaxM2RMSNorm, 0.0, "llama"),
    "gemma3": (Gemma3RMSNorm, 1.0, "gemma"),
    "olmo2": (Olmo2RMSNorm, 0.0, "gemma"),
    "gpt_oss": (GptOssRMSNorm, 0.0, "gemma"),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("x_dtype, w_dtype", [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_torch_backend_equals_hf_module(family, x_dtype, w_dtype, eps):
    hf_class, offset, casting = FAMILIES[family]
    n = 96
    hf = hf_class(n, eps=eps).to(w_dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(0.3 * torch.randn(n, generator=gen) + (1.0 - offset))
    x = make_input((2, 5, n), x_dtype, "padded_rows", scale=3.0)
    with torch.no_grad():
        want = hf(x)
        got = normtools.rms_norm(x, hf.weight, eps, offset=offset, casting=casting, backend="torch")
        module = normtools.RMSNorm(n, eps, offset=offset, casting=casting).to(w_dtype)
        module.weight.copy_(hf.weight)
        module.backend = "torch"
        got_module = module(x)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)
    assert torch.equal(got_module, want)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_casting_conventions_differ_in_bfloat16(family):
    """The other casting convention does not reproduce the module: the parity test can fail."""
    hf_class, offset, casting = FAMILIES[family]
    other = "gemma" if casting == "llama" else "llama"
    n = 256
    hf = hf_class(n).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.linspace(-0.4, 0.4, n) + (1.0 - offset))
    x = make_input((4, n), torch.bfloat16, "contiguous", scale=3.0)
    with torch.no_grad():
        got = normtools.rms_norm(x, hf.weight, offset=offset, casting=other, backend="torch")
        assert not torch.equal(got, hf(x))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("x_dtype, w_dtype", [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
])
@pytest.mark.parametrize("shape", [(64, 256), (8, 4096), (3, 1, 7)], ids=str)
def test_native_rms_norm_equals_the_hf_module_and_the_reference(family, x_dtype, w_dtype, shape):
    """reference.rms_norm_native (F.rms_norm where its bits are the reference's) equals the HF
    module and rms_norm_reference bit for bit, at the bench's shapes; also without a weight,
    with an offset the modules do not use (0.5) and with one weight row per head."""
    hf_class, offset, casting = FAMILIES[family]
    n = shape[-1]
    hf = hf_class(n, eps=1e-6).to(w_dtype)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        hf.weight.copy_(0.3 * torch.randn(n, generator=gen) + (1.0 - offset))
    x = make_input(shape, x_dtype, "contiguous", scale=3.0)
    with torch.no_grad():
        want = hf(x)
        got = rms_norm_native(x, hf.weight, 1e-6, offset, casting)
        assert got.dtype == want.dtype and torch.equal(got, want)
        rows = x.reshape(-1, 1, n)
        per_head = (0.3 * torch.randn(2, n, generator=gen) + 1.0).to(w_dtype)
        for weight, off in ((None, offset), (hf.weight, 0.5), (per_head, offset)):
            x_in = rows.expand(-1, 2, n) if weight is per_head else x
            expected = rms_norm_reference(x_in, weight, 1e-6, off, casting)
            result = rms_norm_native(x_in, weight, 1e-6, off, casting)
            assert result.dtype == expected.dtype and torch.equal(result, expected)
