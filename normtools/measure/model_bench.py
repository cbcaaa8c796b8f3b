"""Model-level benchmark: the step time of a real transformers model before and after
``normtools.patch``.

The op-level sweep (``normtools.measure.bench``) times one norm at a time; what a user feels is
the step of a whole model. ``model_step_times`` builds a transformers model from a config,
times its forward step (inference: ``no_grad``) and its forward + backward step (training: the
causal-LM loss and ``backward()``), then replaces every norm module by a normtools module
(``normtools.patch``, in place) and times the same steps again, on the same inputs.

* On a CPU: a tiny model of a family (``cards.tiny_config``: hidden 32, 2 layers), so that the
  harness runs in seconds; the "after" backend is the normtools reference ("torch"), since
  Triton's interpreter would time Python.
* On a GPU: a full-width layer stack of a bundled published config (``full_width_config``: the
  real hidden size, heads, MLP and vocabulary, fewer layers), the "after" backend "triton".

Timing. A sample is one step, wall clock around it (``time.perf_counter``), the device
synchronized before and after on CUDA: a step includes its host work (launches, Python), as a
real training or decode loop pays it. ``warmup`` steps run first and are discarded. The inputs
are one fixed batch of token ids (cache state "warm": the weights and activations of a step are
whatever the previous step left in cache), one process, one stream. Each row records these
conditions, the percentiles (p50, p95, p99, mean, min in ms), and the parity of the logits after
the patch against before (``parity.compare``), so that a fast but wrong patch shows.
"""

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from normtools.core import sysinfo
from normtools.core.precision import compute_dtype
from normtools.measure import parity
from normtools.measure.bench.timing import summarize

__all__ = ["full_width_config", "model_step_times", "speedups", "main"]

_MODES = ("forward", "forward+backward")


def full_width_config(name="qwen3-8b", layers=4):
    """A bundled published config (``cards.load_bundled_config``) cut to ``layers`` layers: the
    real widths (hidden size, heads, head_dim, MLP, vocabulary) in a stack that fits a quick run."""
    from normtools import cards

    config = dict(cards.load_bundled_config(name))
    text = config.get("text_config")
    target = text if isinstance(text, dict) else config
    target["num_hidden_layers"] = layers
    for key in ("layer_types", "mlp_only_layers"):   # per-layer lists follow the depth
        if isinstance(target.get(key), list):
            target[key] = target[key][:layers]
    return config


def _step(model, ids, mode):
    if mode == "forward":
        with torch.no_grad():
            return model(ids).logits
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits


def _time_steps(model, ids, mode, warmup, reps):
    is_cuda = ids.device.type == "cuda"
    for _ in range(warmup):
        _step(model, ids, mode)
    times = []
    for _ in range(reps):
        if is_cuda:
            torch.cuda.synchronize(ids.device)
        t0 = time.perf_counter()
        _step(model, ids, mode)
        if is_cuda:
            torch.cuda.synchronize(ids.device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def model_step_times(config, *, backend=None, batch=2, seq=64, device="cpu",
                     dtype=torch.float32, warmup=3, reps=30, modes=_MODES, seed=0, label=None):
    """Step times of the model of ``config`` before and after ``normtools.patch``.

    ``backend``: the patched modules' backend (default "triton" on CUDA, "torch" on CPU).
    Returns {"conditions": {...}, "rows": [...]}: one row per (mode, stage) with stage "before"
    (the transformers norms) or "after" (normtools), the percentiles in ms (p50_ms, p95_ms,
    p99_ms, mean_ms, min_ms), norms_replaced, and for "after" the logits' max_abs, max_ulps and
    allclose against "before" on the same inputs.
    """
    from normtools import cards
    from normtools.cards.patching import patch

    device = torch.device(device)
    backend = backend or ("triton" if device.type == "cuda" else "torch")
    torch.manual_seed(seed)
    model = cards.build_model(config, device=device).to(dtype=dtype)
    model.train(False)   # no dropout; the training step's gradients are still taken
    hf = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, hf.vocab_size, (batch, seq), generator=generator).to(device)
    rows, logits = [], {}
    for stage in ("before", "after"):
        replaced = patch(model, backend=backend) if stage == "after" else []
        for mode in modes:
            times = _time_steps(model, ids, mode, warmup, reps)
            stats = {k.replace("_us", "_ms"): v for k, v in summarize(times).items()}
            row = {"mode": mode, "stage": stage, "backend": backend if stage == "after" else
                   "transformers", "norms_replaced": len(replaced), **stats,
                   "max_abs": None, "max_ulps": None, "allclose": None}
            with torch.no_grad():
                out = model(ids).logits.detach()
            if stage == "before":
                logits[mode] = out
            else:
                check = parity.compare(logits[mode], out, reference_name="before",
                                       candidate_name="after")
                row.update(max_abs=check.max_abs, max_ulps=check.max_ulps,
                           allclose=check.allclose)
            rows.append(row)
    conditions = {
        **sysinfo.run_conditions(str(device)), "model": label or hf.model_type,
        "model_type": hf.model_type, "layers": hf.num_hidden_layers,
        "hidden_size": hf.hidden_size, "num_attention_heads": hf.num_attention_heads,
        "num_key_value_heads": getattr(hf, "num_key_value_heads", None),
        "vocab_size": hf.vocab_size, "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(dtype).removeprefix("torch."), "batch": batch, "seq": seq,
        "tokens_per_step": batch * seq, "warmup": warmup, "reps": reps,
        "cache": "warm (one fixed batch of token ids)", "concurrency": "one process, one stream",
        "timer": "wall clock per step (time.perf_counter), device synchronized around it",
    }
    return {"conditions": conditions, "rows": rows}


def speedups(result):
    """{mode: p50(before) / p50(after)}: above 1 when the patched model steps faster."""
    p50 = {(r["mode"], r["stage"]): r["p50_ms"] for r in result["rows"]}
    return {mode: p50[(mode, "before")] / p50[(mode, "after")]
            for mode in {r["mode"] for r in result["rows"]}}


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main(argv=None):
    """``python -m normtools.measure.model_bench``: one model, before and after, as JSON."""
    parser = argparse.ArgumentParser(prog="python -m normtools.measure.model_bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--size", choices=("tiny", "full-width"), default=None,
                        help="tiny (default on CPU) or full-width (default on CUDA)")
    parser.add_argument("--family", default="qwen3", help="family of the tiny model")
    parser.add_argument("--config", default="qwen3-8b", help="bundled config of full-width")
    parser.add_argument("--layers", type=int, default=4, help="layers of the full-width stack")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None)
    parser.add_argument("--backend", choices=("torch", "triton"), default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device
    cuda = torch.device(device).type == "cuda"
    size = args.size or ("full-width" if cuda else "tiny")
    if size == "full-width":
        config, label = full_width_config(args.config, args.layers), \
            f"{args.config}, first {args.layers} layers"
    else:
        from normtools import cards

        config, label = cards.tiny_config(args.family), f"tiny {args.family}"
    result = model_step_times(
        config, backend=args.backend, device=device, label=label,
        batch=args.batch or (4 if cuda else 2), seq=args.seq or (2048 if cuda else 64),
        # bfloat16 on a GPU with bfloat16 arithmetic; a T4 falls back to float16 (with a line)
        dtype=_DTYPES[args.dtype] if args.dtype else (compute_dtype(device) if cuda
                                                       else torch.float32),
        warmup=args.warmup if args.warmup is not None else (5 if cuda else 3),
        reps=args.reps if args.reps is not None else (100 if cuda else 30))
    result["speedup_p50"] = speedups(result)
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    for r in result["rows"]:
        print(f"{r['mode']:<17} {r['stage']:<6} {r['backend']:<12} p50 {r['p50_ms']:9.2f} ms  "
              f"p95 {r['p95_ms']:9.2f}  p99 {r['p99_ms']:9.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
