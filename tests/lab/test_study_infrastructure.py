"""Issue 28's study infrastructure: float32 evaluation of the whole split, independent weight
decay and decayed QK gains (against a float64 hand computation of AdamW's decay), unit-RMS
embeddings, resumable studies with their provenance, and the same-seed reproducibility check."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from normtools.lab import reproduce, studies, study_files
from normtools.lab.data import load_corpus
from normtools.lab.tinylm import TinyLM, TinyLMConfig
from normtools.lab.train import _make_optimizer, evaluate

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data():
    return load_corpus()


def tiny(**overrides):
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig.tiny(**overrides))


def test_whole_split_loss_of_a_uniform_model_is_log_vocab_and_ignores_autocast(data):
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every output logit 0: p = 1/256 for every byte
    assert evaluate(model, data, "val", "all") == pytest.approx(math.log(256), rel=1e-6)  # float32 cross-entropy
    random_model = tiny()
    outside = evaluate(random_model, data, "val", "all")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = evaluate(random_model, data, "val", "all")
    assert inside == outside


def test_whole_split_loss_weights_every_window_once(data):
    """Against a loop over the consecutive windows of a shortened split, one window at a time,
    the log-softmax in float64."""
    model = tiny()
    short = type(data)(train=data.train, val=data.val[:16 * 40 + 5])
    T = model.config.max_seq_len
    nll = []
    for start in range(0, (short.val.numel() - 1) // T * T, T):
        x, y = short.val[start:start + T], short.val[start + 1:start + T + 1]
        with torch.no_grad():
            log_p = torch.log_softmax(model(x[None])[0][0].double(), -1)
        nll.append(-log_p[torch.arange(T), y])
    assert evaluate(model, short, "val", "all") == pytest.approx(torch.cat(nll).mean().item(), rel=1e-5)
    with pytest.raises(ValueError, match="batches"):
        evaluate(model, short, "val", 0)


@pytest.mark.parametrize("independent", [False, True])
def test_weight_decay_is_coupled_or_independent_of_the_peak_lr(independent):
    """With zero gradients AdamW's update is the decay alone: p ← p·(1 − η_t·λ'), λ' = λ
    (coupled) or λ/η (independent)."""
    model = tiny(qk_norm="per_head")
    lr, step_lr, wd = 0.5, 0.2, 0.01
    optimizer = _make_optimizer(model, lr, wd, independent_weight_decay=independent,
                                qk_gain_weight_decay=True)
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        group["lr"] = step_lr
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    factor = 1 - step_lr * (wd / lr if independent else wd)
    for name, p in model.named_parameters():
        decayed = p.dim() >= 2 or ".qk_norm." in name
        expected = before[name] * (factor if decayed else 1.0)
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-6, atol=0)


def test_qk_gains_are_exempt_from_weight_decay_by_default():
    model = tiny(qk_norm="per_head")
    optimizer = _make_optimizer(model, 0.1, 0.1)
    gains = {id(p) for n, p in model.named_parameters() if ".qk_norm." in n}
    assert gains
    for group in optimizer.param_groups:
        if group["weight_decay"] > 0:
            assert not gains & {id(p) for p in group["params"]}


def test_embed_std_gives_unit_rms_embeddings_and_leaves_the_rest():
    model = TinyLM(TinyLMConfig(width=64, depth=2, heads=4, max_seq_len=16, embed_std=1.0,
                                init_std=64 ** -0.5))
    assert model.embed.weight.pow(2).mean().sqrt().item() == pytest.approx(1.0, rel=0.02)
    assert model.layers[0].self_attn.q_proj.weight.std().item() == pytest.approx(0.125, rel=0.05)
    with pytest.raises(ValueError, match="embed_std"):
        TinyLMConfig(embed_std=0.0)


def _mini_study():
    return studies.Study("mini", "a test study", {"a": {"placement": "pre"},
                                                  "b": {"placement": "pre", "qk_norm": "per_head"}},
                         lrs=(1e-2,), seeds=(0, 1), steps=3, thresholds={"logit_ratio": 10.0})


def test_a_study_resumes_where_it_stopped(tmp_path, monkeypatch):
    monkeypatch.setitem(studies.STUDIES, "mini", _mini_study())
    trained = []
    real = studies.run_record

    def counting(study, cell, *args, **kwargs):
        trained.append((cell["variant"], cell["seed"]))
        return real(study, cell, *args, **kwargs)
    monkeypatch.setattr(studies, "run_record", counting)
    out = tmp_path / "mini.json"
    first = studies.run_study("mini", "test", out=out, max_runs=3)
    on_disk = json.loads(out.read_text())
    assert len(on_disk["runs"]) == 3 and on_disk["complete"] is False and not first["complete"]
    assert trained == [("a", 0), ("b", 0), ("a", 1)]  # seed by seed: partial studies pair up
    second = studies.run_study("mini", "test", out=out)
    assert trained[3:] == [("b", 1)]  # only the missing run
    on_disk = json.loads(out.read_text())
    assert on_disk["complete"] is True and second["complete"] is True
    assert json.dumps(on_disk["runs"][:3]) == json.dumps(first["runs"])  # kept, not retrained
    assert on_disk["thresholds"]["logit_ratio"] == 10.0
    assert on_disk["thresholds"]["confidence"] == 0.95
    assert on_disk["conditions"]["model"]["backend"] == "torch"
    assert on_disk["conditions"]["evaluation"].startswith("whole validation split, float32")
    head = (REPO / ".git" / "HEAD").read_text().strip()
    ref = REPO / ".git" / head[5:] if head.startswith("ref: ") else None
    if ref is not None and ref.exists():
        assert on_disk["provenance"]["commit"] == ref.read_text().strip()
    assert all(run["commit"] == on_disk["provenance"]["commit"] for run in on_disk["runs"])
    assert isinstance(on_disk["provenance"]["dirty"], bool)
    # a file from another configuration is refused, not mixed in
    monkeypatch.setitem(studies.STUDIES, "mini", studies.Study(**{**_mini_study().__dict__, "steps": 4}))
    with pytest.raises(ValueError, match="steps"):
        studies.run_study("mini", "test", out=out)


def test_reproducibility_check_is_the_same_seed_at_float_tolerance(tmp_path, monkeypatch):
    monkeypatch.setitem(studies.STUDIES, "mini", studies.Study(
        **{**_mini_study().__dict__, "check": {"variant": "b", "lr": 1e-2, "seed": 1}}))
    document = studies.run_study("mini", "test")
    chosen, record = reproduce.rerun(document)
    check = reproduce.compare_rerun(document, chosen, record)
    assert check["reproduced"].all(), check.to_string()
    for run in document["runs"]:
        if (run["variant"], run["seed"]) == ("b", 1):
            run["final_loss"] *= 1 + 5 * reproduce.REPRODUCTION_RTOL["final_loss"]
    assert not reproduce.compare_rerun(document, chosen, record, metrics=("final_loss",))["reproduced"].any()


def test_relu_mlp_is_the_original_ffn_with_4d_hidden_and_xavier_init():
    torch.manual_seed(0)
    config = TinyLMConfig(width=64, depth=1, heads=4, max_seq_len=8, mlp="relu", init_scheme="xavier")
    model = TinyLM(config)
    mlp = model.layers[0].mlp
    assert mlp.up_proj.weight.shape == (256, 64) and mlp.down_proj.weight.shape == (64, 256)
    x = torch.randn(3, 64)
    expected = mlp.down_proj.weight.double() @ torch.clamp(mlp.up_proj.weight.double() @ x.double().T, min=0)
    torch.testing.assert_close(mlp(x).double(), expected.T, rtol=1e-5, atol=1e-6)
    # Glorot normal: std √(2 / (fan_in + fan_out)) for every linear layer
    for weight in (mlp.up_proj.weight, model.layers[0].self_attn.q_proj.weight, model.lm_head.weight):
        fan_out, fan_in = weight.shape
        assert weight.std().item() == pytest.approx(math.sqrt(2 / (fan_in + fan_out)), rel=0.1)
    with pytest.raises(ValueError, match="mlp"):
        TinyLMConfig(mlp="gelu")


def test_bf16_argmax_changes_and_total_variation_against_numpy():
    from normtools.lab.probes import causal_mask, low_precision_attention

    rng = np.random.default_rng(1)
    s = (1000 + rng.uniform(0, 6, (2, 3, 8, 8))).astype(np.float32)  # spacing 4 at 1000: near ties
    valid = np.tril(np.ones((8, 8), dtype=bool))
    rounded = torch.from_numpy(s).to(torch.bfloat16).float().numpy().astype(np.float64)
    exact = s.astype(np.float64)

    def softmax(v):
        v = np.where(valid, v, -np.inf)
        e = np.exp(v - v.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    argmax_changed = np.mean(np.where(valid, exact, -np.inf).argmax(-1)
                             != np.where(valid, rounded, -np.inf).argmax(-1))
    tv = np.mean(0.5 * np.abs(softmax(exact) - softmax(rounded)).sum(-1))
    stats = low_precision_attention(torch.from_numpy(s), causal_mask(8, "cpu"))
    assert 0 < argmax_changed and stats["argmax_changed"] == pytest.approx(argmax_changed, abs=1e-7)
    assert stats["tv_mean"] == pytest.approx(tv, rel=1e-3, abs=1e-6)


@pytest.mark.parametrize("size", ["cpu", "gpu", "test"], ids=["size_cpu", "size_of_a_gpu", "size_test"])
def test_a_top_of_the_sweep_control_follows_each_size_s_grid(size):
    """lr_sweep's no-clip arm runs at the two highest learning rates of the size's own grid
    (grid.STABILITY_SIZES), so the highest rate holds every variant (chapter 4a compares them
    there); a fixed pair of rates put it alone at 1.0 when the gpu grid ends at 0.3."""
    from normtools.lab.grid import STABILITY_SIZES

    study = studies.STUDIES["lr_sweep"]
    grid_lrs = sorted(STABILITY_SIZES[size]["sweep_lrs"])
    lrs_of = {}
    for cell in study.cells(size):
        lrs_of.setdefault(cell["variant"], set()).add(cell["lr"])
    assert lrs_of.pop("no QK-Norm, no clip") == set(grid_lrs[-2:])
    assert all(lrs == set(grid_lrs) for lrs in lrs_of.values())
    document = studies.new_document("lr_sweep", size)
    assert document["conditions"]["variant_lrs"] == {"no QK-Norm, no clip": grid_lrs[-2:]}


def test_runs_carry_the_commit_their_process_started_at(tmp_path, monkeypatch):
    """A commit made while a long study trains is not the code its runs imported."""
    monkeypatch.setitem(studies.STUDIES, "mini", _mini_study())
    commits = iter(f"{i:040d}" for i in range(100))
    monkeypatch.setattr(studies, "provenance",
                        lambda root=None: {"commit": next(commits), "dirty": False, "dirty_paths": []})
    document = studies.run_study("mini", "test", out=tmp_path / "mini.json")
    started = {run["commit"] for run in document["runs"]}
    assert started == {f"{1:040d}"}  # new_document took the first, run_study the second


def _refuse_training(*args, **kwargs):
    raise AssertionError("trained before the bad input was refused")


def test_a_rerun_of_a_configuration_the_study_has_no_run_of_is_refused_before_training(tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setitem(studies.STUDIES, "mini", studies.Study(
        **{**_mini_study().__dict__, "check": {"variant": "b", "lr": 1e-2, "seed": 1}}))
    path = tmp_path / "mini.json"
    document = studies.run_study("mini", "test", out=path, max_runs=1)  # ("a", 0.01, 0) alone
    monkeypatch.setattr(studies, "run_record", _refuse_training)
    monkeypatch.setattr(reproduce, "subprocess", SimpleNamespace(run=_refuse_training))
    for variant, lr, seed in [(None, None, None), ("a", None, 7), ("a", None, -5), ("bogus", None, 0),
                              ("a", 0.5, 0)]:
        with pytest.raises(ValueError, match=r"no run of .* it has runs of variants \['a'\], "
                                             r"lrs \[0\.01\], seeds \[0\]"):
            reproduce.rerun(document, variant, lr, seed)
        with pytest.raises(ValueError, match="no run of"):
            reproduce.rerun_on_committed_path(path, variant, lr, seed)
    assert reproduce.committed_run(document, "a", 0.01, 0) == {"variant": "a", "lr": 0.01, "seed": 0}


def test_merge_refuses_a_part_given_twice(tmp_path, monkeypatch):
    monkeypatch.setitem(studies.STUDIES, "mini", _mini_study())
    part = tmp_path / "part.json"
    studies.run_study("mini", "test", out=part, max_runs=1)
    for paths in ([part, part], [part, tmp_path / "." / "part.json"]):
        with pytest.raises(ValueError, match="part.json is given twice"):
            studies.merge_studies(paths)


@pytest.mark.parametrize("text", ["[]", "{}", '{"study": "mini", "size": "test"}', "{bad",
                                  '{"study": "mini", "size": "test", "thresholds": {}, "conditions": '
                                  '{"model": {}, "seeds": [0], "machine": {}}, "runs": []}'],
                         ids=["list", "empty", "half", "not_json", "machine_without_fields"])
def test_a_file_that_is_not_a_study_is_refused_naming_it_before_any_work(text, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setitem(studies.STUDIES, "mini", _mini_study())
    monkeypatch.setattr(studies, "run_record", _refuse_training)
    monkeypatch.setattr(studies, "load_corpus", _refuse_training)
    monkeypatch.setattr(reproduce, "subprocess", SimpleNamespace(run=_refuse_training))
    path = tmp_path / "odd.json"
    path.write_text(text)
    refusals = [lambda: study_files.read_study(path), lambda: studies.run_study("mini", "test", out=path),
                lambda: studies.merge_studies([path]), lambda: studies.load_study(path),
                lambda: reproduce.rerun_on_committed_path(path)]
    if "machine" not in text:  # the last document would do as an init probe's
        refusals += [lambda: studies.run_init_probe("xiong_wide", out=path),
                     lambda: studies.load_init_probe(path)]
    for refusal in refusals:
        with pytest.raises(ValueError, match=r"odd\.json is not (a study|an init probe|JSON)"):
            refusal()


@pytest.mark.parametrize("device", ["meta", "cuda:99"])
def test_lab_run_refuses_a_device_that_cannot_train_here_before_training(device, tmp_path,
                                                                        monkeypatch, capsys):
    from normtools.cli import main

    monkeypatch.setattr(studies, "run_study", _refuse_training)
    assert main(["lab", "run", "placements", "--size", "test", "--device", device,
                 "--out", str(tmp_path / "p.json")]) == 2
    error = capsys.readouterr().err
    assert f"error: --device {device} cannot train here" in error and "internal" not in error
