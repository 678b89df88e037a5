"""Where a quantized model on the GPU departs from its dequantized twin (issue 19).

    python bench/diag_quant_model.py [--model FILE.gguf] [--tokens 1,4,16,30]

1. Every QuantizedWeight the quantized engine holds (fused qkv / gate_up included), as the
   engine holds it: its blocks dequantized by the kernel against gguf-py on the same bytes
   (bit-exact after the cast is the contract), and qlinear at each --tokens count against
   F.linear on gguf-py's values (relative error of the output's scale).
2. The first greedy tokens of both engines on a chat prompt, with the first token's top five
   logprobs (a near-tie or a broken path).

Default model: the embedded SmolLM2 (strata pull). Prints one line per weight and check.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default model)")
    parser.add_argument("--tokens", default="1,4,16,30", help="qlinear row counts to check")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    return args


def _engine(path: Path, device: str, quantized: bool):
    from strata.engine.core.engine import Engine, EngineConfig

    saved = os.environ.get("STRATA_QUANTIZED")
    os.environ["STRATA_QUANTIZED"] = "1" if quantized else "0"
    try:
        engine = Engine(EngineConfig(model_path=str(path), device=device, context_tokens=1024))
        engine.load()  # the setting is read at load
    finally:
        if saved is None:
            del os.environ["STRATA_QUANTIZED"]
        else:
            os.environ["STRATA_QUANTIZED"] = saved
    return engine


def weight_rows(engine, token_counts) -> int:
    """Prints each quantized weight's checks; returns how many failed."""
    import gguf
    import torch
    import torch.nn.functional as F

    from strata.engine.core.quant import kernels
    from strata.engine.core.quant.weight import QuantizedWeight, qlinear

    failures = 0
    seen = set()
    for name, module in engine.model.named_modules():
        for attr in ("weight", "qkv_weight", "gate_up_weight"):
            weight = getattr(module, attr, None)
            if not isinstance(weight, QuantizedWeight) or id(weight) in seen:
                continue
            seen.add(id(weight))
            raw = weight.raw.cpu().numpy()
            ref = torch.from_numpy(gguf.quants.dequantize(raw, weight.qtype)).to(weight.device)
            got = kernels.dequantize(weight.raw, weight.qtype, weight.shape[1], weight.dtype)
            exact = torch.equal(got, ref.to(weight.dtype))
            errors = []
            gen = torch.Generator(device=weight.device).manual_seed(0)
            for count in token_counts:
                x = torch.randn(count, weight.shape[1], device=weight.device,
                                generator=gen).to(weight.dtype)
                expected = F.linear(x.float(), ref)
                out = qlinear(x, weight).float()
                errors.append((out - expected).abs().max().item()
                              / max(expected.abs().max().item(), 1e-30))
            bad = not exact or max(errors) > 2e-2
            failures += bad
            print(f"{'BAD ' if bad else 'ok  '}{name}.{attr} {weight.qtype.name} "
                  f"{tuple(weight.shape)} ptr%16={weight.raw.data_ptr() % 16} "
                  f"dequant exact={exact} qlinear rel err "
                  + " ".join(f"{c}:{e:.2e}" for c, e in zip(token_counts, errors)), flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from strata.default_model import default_model_path
    from strata.engine.protocol import SamplingSpec
    from strata.engine.text import load_text_assets

    path = args.model or default_model_path(fetch=False)
    assets = load_text_assets(path)
    prompt = assets.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    spec = SamplingSpec(max_tokens=8, temperature=0.0, num_logprobs=5)
    results = {}
    for quantized in (False, True):
        engine = _engine(path, args.device, quantized)
        try:
            if quantized:
                print(f"{weight_rows(engine, args.tokens)} weights failed", flush=True)
            tokens, records = [], []
            for step in engine.generate(prompt, spec):
                tokens += step
                records += engine.take_logprobs()
            results[quantized] = tokens
            first = [(t, round(v, 3)) for t, v in records[0].top] if records else []
            print(f"quantized={quantized}: greedy {tokens} {assets.decode(tokens)!r}; first "
                  f"token's top logprobs {first}", flush=True)
        finally:
            engine.close()
    return 0 if results[True] == results[False] else 1


if __name__ == "__main__":
    sys.exit(main())
