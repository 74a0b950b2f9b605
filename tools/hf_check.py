"""Random weights at real model dimensions, a few layers: the patched model's logits and greedy tokens against
transformers' own (issue 18 item 2), and both against the same weights run in float32.

Writes hf_check.md (one row per model), hf_check.json and a result file (autosel.bench.results) under --out.

    python tools/hf_check.py --out "$OUT"                                   # on the H200: cuda, bf16, measured kernels
    python tools/hf_check.py --device cpu --backend torch --out /tmp/hf     # on a CPU
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from autosel.bench.models import MODELS, build
from autosel.bench.results import write_result
from autosel.checks import TOLERANCES
from autosel.errors import IntegrationError
from autosel.integrations.transformers import patch_model
from autosel.spec import KernelBackend

def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The first generated step where the two greedy sequences differ, else None."""
    differs = (a != b).any(dim=0).nonzero()
    return None if differs.numel() == 0 else int(differs[0])


def check(name: str, args) -> dict:
    dtype = getattr(torch, args.dtype)
    model = build(name, args.layers, args.device, dtype)
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens), device=args.device)
    generate = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                    do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model(ids).logits.float()
        expected_tokens = model.generate(**generate)[:, args.tokens:]
        began = time.perf_counter()
        patched = patch_model(model, backend=args.backend, mode=args.mode, projections=args.projections)
        patch_s = time.perf_counter() - began
        got = model(ids).logits.float()
        got_tokens = model.generate(**generate)[:, args.tokens:]
        step = first_difference(expected_tokens, got_tokens)
        # Where greedy decoding parted, how close transformers' own top two were (a near tie flips within tolerance).
        margin = None
        if step is not None:
            prefix = torch.cat((ids, expected_tokens[:, :step]), dim=1)
            patched.undo()
            top2 = model(prefix).logits[:, -1].float().topk(2).values
            parted = expected_tokens[:, step] != got_tokens[:, step]
            margin = float((top2[:, 0] - top2[:, 1])[parted].min())
        patched.undo()
        truth = model.float()(ids).logits  # the same weights in float32, transformers' code
    rtol, atol = TOLERANCES[args.dtype]
    return {
        "model": name, "layers": args.layers, "device": args.device, "dtype": args.dtype, "mode": patched.mode,
        "backend": args.backend or "measured", "counts": patched.counts, "skipped": patched.skipped,
        "patch_s": round(patch_s, 2), "max_abs_diff": float((got - expected).abs().max()),
        "logit_scale": float(expected.abs().max()),
        "allclose": bool(torch.allclose(got, expected, rtol=rtol, atol=atol)),  # element by element
        # bf16 spaces values near the largest logit 2^-8 of it apart, and the lm_head's reduction errors scale with it.
        "within_scale": bool((got - expected).abs().max() <= rtol * expected.abs().max()),
        "argmax_agree": float((got.argmax(-1) == expected.argmax(-1)).float().mean()),
        "err_vs_fp32_patched": float((got - truth).abs().max()),
        "err_vs_fp32_transformers": float((expected - truth).abs().max()),
        "tokens_equal": step is None, "first_token_difference": step, "top2_margin_there": margin,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", choices=sorted(MODELS), help="default: llama-3-8b and qwen3-8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--backend", help="one backend for every op; default: the measured winners")
    parser.add_argument("--mode", choices=["eager", "graph"])
    parser.add_argument("--projections", action="store_true", help="also route the projections through gemm.mm")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.backend:
        try:
            args.backend = KernelBackend.parse(args.backend).value
        except ValueError as exc:
            parser.error(f"--backend: {exc}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.model or ["llama-3-8b", "qwen3-8b"]:
        try:
            rows.append(check(name, args))
        except IntegrationError as exc:  # patch_model refused (--backend cannot run here, say): its sentence says why
            raise SystemExit(f"{name}: {exc}") from None
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache() if args.device == "cuda" else None
    (args.out / "hf_check.json").write_text(json.dumps({"transformers": transformers.__version__,
                                                        "torch": torch.__version__, "rows": rows}, indent=1))
    lines = [f"transformers {transformers.__version__}, torch {torch.__version__}", "",
             "| model | layers | device | dtype | mode | backend | max abs diff (logit scale) | within rtol x scale "
             "| allclose | argmax agree | max err vs fp32: patched / transformers | greedy tokens |", "|" + "---|" * 12]
    for r in rows:
        tokens = "equal" if r["tokens_equal"] else (f"differ from step {r['first_token_difference']} "
                                                    f"(top-2 margin there {r['top2_margin_there']:.3g})")
        backend = r["backend"] + (" + gemm.mm" if r["counts"]["gemm"] else "")
        lines.append(f"| {r['model']} | {r['layers']} | {r['device']} | {r['dtype']} | {r['mode']} | {backend} "
                     f"| {r['max_abs_diff']:.3g} ({r['logit_scale']:.3g}) | {r['within_scale']} | {r['allclose']} "
                     f"| {r['argmax_agree']:.4f} "
                     f"| {r['err_vs_fp32_patched']:.3g} / {r['err_vs_fp32_transformers']:.3g} | {tokens} |")
    (args.out / "hf_check.md").write_text("\n".join(lines) + "\n")
    header = lines[2].strip("|").split(" | ")
    table = [line.strip("| ").split(" | ") for line in lines[4:]]
    write_result("model_check", {"rows": rows, "tables": [{"columns": [h.strip() for h in header], "rows": table}]},
                 folder=args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
