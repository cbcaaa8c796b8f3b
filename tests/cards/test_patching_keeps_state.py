"""Issue 34: ``normtools.patch`` keeps the model's own norm parameters and hooks, so freezing,
an optimizer built before patching and forward hooks behave as before the patch."""

import pytest
import torch

import normtools
from normtools import cards
from normtools.cards.patching import PatchError

pytest.importorskip("transformers")


def tiny_llama():
    torch.manual_seed(0)
    return cards.build_model(cards.tiny_config("llama")).eval()


def norm_parameters(model):
    return {name: p for name, p in model.named_parameters() if "norm" in name}


def test_a_frozen_model_stays_frozen():
    model = tiny_llama().requires_grad_(False)
    normtools.patch(model, backend="torch")
    assert norm_parameters(model) and not any(p.requires_grad for p in model.parameters())


def test_patch_keeps_the_parameter_objects_so_an_earlier_optimizer_trains_the_norms():
    model = tiny_llama()
    before = norm_parameters(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    normtools.patch(model, backend="torch")
    after = norm_parameters(model)
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    start = {n: p.detach().clone() for n, p in after.items()}
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    model(ids).logits.square().mean().backward()
    optimizer.step()
    assert all(not torch.equal(p, start[n]) for n, p in norm_parameters(model).items())


def test_forward_hooks_on_the_old_norms_fire_on_the_new_ones_and_their_handles_still_remove_them():
    model = tiny_llama()
    seen = []
    handle = model.model.norm.register_forward_hook(lambda module, args, out: seen.append(type(module)))
    pre = model.model.layers[0].input_layernorm.register_forward_pre_hook(lambda m, a: seen.append("pre"))
    normtools.patch(model, backend="torch")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    model(ids)
    assert seen == ["pre", normtools.RMSNorm]
    handle.remove(), pre.remove()
    model(ids)
    assert len(seen) == 2


def test_a_norm_whose_forward_was_replaced_is_refused_and_the_model_left_untouched():
    model = tiny_llama()
    norm = model.model.norm
    norm.forward = lambda x: x   # what accelerate's add_hook_to_module does
    with pytest.raises(PatchError, match="forward replaced"):
        normtools.patch(model, backend="torch")
    assert model.model.norm is norm
