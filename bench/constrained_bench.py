"""Per-token cost of constrained decoding (json_schema) at batch 1: decode tok/s with and without.

    python bench/constrained_bench.py [--models smollm2-135m llama3-8b] [--tokens 256]
        [--json docs/bench-results/constrained-h200.json]

Two parts. Mask cost: llguidance's bitmask per token on the default model's vocabulary (CPU,
any machine). Decode (CUDA): seeded random bf16 weights of each preset, the GraphDecoder the
engine uses, `--tokens` decode steps unconstrained (the whole step in a CUDA graph) against the
same steps under a JSON schema (graph to the logits, mask from the host, sampling after:
core/fast/constrained_decode.py). The matcher uses the default model's tokenizer padded to the
preset's vocabulary (random weights have none); the schema forces a long array of short
strings so every step is constrained. Target (DESIGN §8): >= 0.9 of unconstrained tok/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llguidance
import torch
from report import figure, format_figures, write_json

from strata.default_model import default_model_path
from strata.engine.api.grammar import json_schema_grammar
from strata.engine.core.constraint import build_constraint
from strata.engine.protocol import SamplingSpec

SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "items": {"type": "string"}, "minItems": 200}},
    "required": ["items"], "additionalProperties": False}
# maxLength makes llguidance check each token's length in the lexer: far dearer per mask.
BOUNDED_SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 200}},
    "required": ["items"], "additionalProperties": False}
TARGET = 0.9
PROMPT_TOKENS = 64


def mask_cost_us(model_path: str, num_tokens: int, schema: dict) -> list[float]:
    """Microseconds per bitmask on a random walk of allowed tokens."""
    from strata.engine.text import load_text_assets

    assets = load_text_assets(model_path)
    constraint = build_constraint(json_schema_grammar(schema, "schema"), model_path,
                                  assets.vocab_size, assets.eos_token_ids, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    times_us = []
    for _ in range(num_tokens):
        start = time.perf_counter()
        constraint.fill_bitmask()
        times_us.append((time.perf_counter() - start) * 1e6)
        allowed = constraint.allowed().nonzero().flatten()
        token = int(allowed[torch.randint(len(allowed), (1,), generator=generator)])
        if token in assets.eos_token_ids:
            break
        constraint.consume(token)
    return times_us


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_tok_s(label: str, model_path: str, num_tokens: int, device: torch.device,
                 runs: int = 3) -> tuple[float, float]:
    """(unconstrained, constrained) decode tok/s of a preset (CUDA graphs on a GPU; the CPU
    runs the same steps eagerly, as a smoke test of this bench)."""
    from speed_rows import engine_model

    from strata.engine.core.fast import GraphDecoder
    from strata.engine.core.fast.constrained_decode import constrained_decode
    from strata.engine.core.kv_cache import KVCache

    model = engine_model(label, device)
    config = model.config
    decoder = GraphDecoder(model)
    kv = KVCache.for_config(config, PROMPT_TOKENS + num_tokens + 8, torch.bfloat16, device)
    spec = SamplingSpec(max_tokens=num_tokens, temperature=0.0)
    ids = torch.randint(0, config.vocab_size, (PROMPT_TOKENS,), device=device)
    grammar = json_schema_grammar(SCHEMA, "schema")

    def run(constrained: bool) -> float:
        logits = decoder.prefill(kv, ids, 0)
        constraint = None
        if constrained:
            constraint = build_constraint(grammar, model_path, config.vocab_size, (), device)
            logits = constraint.mask(logits)
        first = decoder.sample_first(logits, spec)
        if constraint is not None:
            constraint.consume(first)
        _sync(device)
        start = time.perf_counter()
        steps = (constrained_decode(decoder, kv, first, PROMPT_TOKENS, num_tokens, spec,
                                    constraint) if constrained else
                 decoder.decode(kv, first, PROMPT_TOKENS, num_tokens, spec,
                                continue_request=True))
        count = sum(1 for _ in steps)
        _sync(device)
        return count / (time.perf_counter() - start)

    for constrained in (False, True):  # capture graphs, warm the matcher's tokenizer
        run(constrained)
    plain = statistics.median(run(False) for _ in range(runs))
    masked = statistics.median(run(True) for _ in range(runs))
    return plain, masked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "llama3-8b"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu: a smoke test of the decode rows, not a figure")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokenizer", default=None,
                        help="a GGUF with the default model's vocabulary (weights not needed), "
                        "for a machine without the model; default: the default model")
    args = parser.parse_args()
    model_path = args.tokenizer or str(default_model_path(fetch=True, progress=False))
    figures = []
    for name, schema in (("strings", SCHEMA), ("maxLength strings", BOUNDED_SCHEMA)):
        costs = sorted(mask_cost_us(model_path, args.tokens, schema))
        figures += [figure(f"mask, {name}, median", statistics.median(costs), "us"),
                    figure(f"mask, {name}, p99", costs[int(len(costs) * 0.99) - 1], "us")]
    device = torch.device(args.device)
    if device.type == "cuda" or (args.device == "cpu" and "--device" in sys.argv):
        for label in args.models:
            plain, masked = decode_tok_s(label, model_path, args.tokens, device, args.runs)
            figures.append(figure(f"{label} decode, unconstrained", plain, "tok/s"))
            figures.append(figure(f"{label} decode, json_schema", masked, "tok/s", limit=plain,
                                  target=TARGET))
    print(format_figures(figures, limit_header="plain"))
    write_json({"llguidance": llguidance.__version__, "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                "figures": figures}, args.json)


if __name__ == "__main__":
    main()
