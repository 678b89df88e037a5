"""Speed rows of `strata bench`: decode, prefill, TTFT and the 32k prompt, on random weights.

Each row function takes the BenchContext and returns figure dicts (figure, value, unit, limit,
ratio, target, ok, notes); suite.py prints and saves them. Rooflines: decode is bound by the
bytes a token reads (weights it touches + the K/V of the used context) over the measured HBM
bandwidth; prefill by the FLOPs of the prompt over the measured bf16 matrix rate.
"""

from __future__ import annotations

import time

import torch
from report import figure  # bench/report.py; suite.py puts bench/ on sys.path

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.fused_views import fuse_by_copy
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.random_weights import build_random_model, random_weights_config
from strata.engine.protocol import SamplingSpec

GREEDY = SamplingSpec(max_tokens=1 << 20, temperature=0.0)
DENSE_DECODE_TARGET = 0.75
MOE_DECODE_TARGET = 0.50
PREFILL_TARGET = 0.50


def decode_bytes_per_token(config: ModelConfig, context_tokens: int, element_bytes: int = 2):
    """Bytes one decode step must read: weights it touches and the K/V of the context."""
    h, layers = config.hidden_size, config.num_hidden_layers
    q_dim, kv_dim = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    attention = layers * (2 * h * q_dim + 2 * h * kv_dim)
    mlp = 0
    for i in range(layers):
        if config.is_moe and i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0:
            mlp += config.num_experts_per_tok * 3 * h * config.moe_intermediate_size
            mlp += config.num_experts * h  # router
        else:
            mlp += 3 * h * config.intermediate_size
    head = config.vocab_size * h  # the embedding row read is negligible
    kv = context_tokens * 2 * layers * kv_dim
    return (attention + mlp + head + kv) * element_bytes


def prefill_flop(config: ModelConfig, num_tokens: int, start_pos: int = 0) -> float:
    """Matrix FLOPs of prefilling num_tokens after start_pos (active weights + attention)."""
    weight_bytes_per_token = decode_bytes_per_token(config, 0, element_bytes=1)
    weight_flop = 2 * weight_bytes_per_token * num_tokens
    # QK^T and PV: 2 products x 2 FLOP per multiply-add, causal so half the square.
    mean_keys = start_pos + num_tokens / 2
    attention_flop = (4 * config.num_hidden_layers * config.num_attention_heads
                      * config.head_dim * num_tokens * mean_keys)
    return weight_flop + attention_flop


def engine_model(label: str, device) -> torch.nn.Module:
    """A preset with seeded random bf16 weights, laid out as the engine's arenas lay it out
    (fused q/k/v and gate/up views)."""
    model = build_random_model(random_weights_config(label), device, torch.bfloat16, seed=0)
    fuse_by_copy(model)
    return model


def _prompt(config: ModelConfig, num_tokens: int, device) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(num_tokens)
    return torch.randint(0, config.vocab_size, (num_tokens,), generator=generator).to(device)


def _sync_s(start_s: float) -> float:
    torch.cuda.synchronize()
    return time.perf_counter() - start_s


def tuned_prefill(decoder: GraphDecoder) -> str:
    """Tune the decoder's prefill as a load does (GraphDecoder.tune_prefill); notes for a row."""
    graphs = decoder.tune_prefill()["graphs"]
    called = "compiled" if decoder.prefill_ops.is_compiled else "eager"
    if not graphs:
        return f"called prefill ({called} groups), no graphs"
    return (f"graphs up to {graphs['graph_tokens']} tok (chunk replay "
            f"{graphs['chunk_replay_s'] * 1e3:.1f} ms, host {graphs['host_s'] * 1e3:.1f} ms), "
            f"else called ({called} groups)")


def decode_rows(ctx, model, label: str, moe_impls: list[str]) -> list[dict]:
    """Decode tok/s after a prompt for each MoE implementation (one for dense), plus TTFT."""
    config, args = model.config, ctx.args
    prompt = _prompt(config, args.prompt_tokens, ctx.device)
    max_tokens = args.prompt_tokens + args.decode_tokens
    kv = KVCache.for_config(config, max(max_tokens, 2048), torch.bfloat16, ctx.device)
    context = args.prompt_tokens + args.decode_tokens / 2
    roofline = ctx.limits["hbm_gb_s"] * 1e9 / decode_bytes_per_token(config, int(context))
    target = MOE_DECODE_TARGET if config.is_moe else DENSE_DECODE_TARGET
    rows = []
    for impl in moe_impls:
        decoder = GraphDecoder(model, moe_impl=impl)
        logits = decoder.prefill(kv, prompt, 0)
        first = decoder.sample_first(logits, GREEDY)
        decoder.prepare(kv, args.prompt_tokens, args.decode_tokens, GREEDY)
        best_s = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            n = sum(1 for _ in decoder.decode(kv, first, args.prompt_tokens, args.decode_tokens, GREEDY))
            best_s = min(best_s, _sync_s(t0))
        name = f"{label} decode bs1" + (f" [{decoder.moe_impl}]" if config.is_moe else "")
        note = (f"graphs={decoder.use_cuda_graphs} compiled={decoder.ops.is_compiled} "
                f"fused_attention={decoder.ops.fused_attention} {decoder.note}")
        rows.append(figure(name, n / best_s, "tok/s", roofline, target, note.strip()))
        ctx.log(f"  {name}: {n / best_s:.1f} tok/s ({n / best_s / roofline:.0%} of roofline; "
                f"fused_attention={decoder.ops.fused_attention})")
        if impl == moe_impls[0]:
            # TTFT: prompt in, first token on the host (prefill + head + sample), with the
            # prefill tuned as a load tunes it (graphs for fresh prompts where they pay).
            notes = tuned_prefill(decoder)
            best_ttft = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                next(iter(decoder.generate(kv, prompt.tolist(), GREEDY, 1)))
                best_ttft = min(best_ttft, time.perf_counter() - t0)
            rows.append(figure(f"{label} TTFT {args.prompt_tokens} tok", best_ttft * 1e3, "ms",
                               notes=notes))
        decoder.clear()
    del kv
    torch.cuda.empty_cache()
    return rows


def prefill_rows(ctx, model, label: str, num_tokens: int, oom_check: bool = False) -> list[dict]:
    """Prefill tok/s of one prompt and its ratio to the matrix rate; peak memory for long ones."""
    config = model.config
    decoder = GraphDecoder(model)
    tuned = tuned_prefill(decoder)
    kv = KVCache.for_config(config, num_tokens, torch.bfloat16, ctx.device)
    prompt = _prompt(config, num_tokens, ctx.device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    base_bytes = torch.cuda.memory_allocated(ctx.device)
    # Warm-up: the prompt itself captures its prefill graph where one takes it (its memory
    # pool, allocated here, counts in the peak); a long one only compiles.
    decoder.prefill(kv, prompt[:1024] if oom_check else prompt, 0)
    repeats = 1 if oom_check else ctx.args.repeats
    best_s = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        decoder.prefill(kv, prompt, 0)
        best_s = min(best_s, _sync_s(t0))
    peak_mib = (torch.cuda.max_memory_allocated(ctx.device) - base_bytes) / (1 << 20)
    achieved_tflop_s = prefill_flop(config, num_tokens) / best_s / 1e12
    name = f"{label} prefill {num_tokens} tok"
    notes = f"{achieved_tflop_s:.0f} TFLOP/s; activation peak {peak_mib:.0f} MiB; {tuned}"
    ctx.log(f"  {name}: {num_tokens / best_s:.0f} tok/s, {notes}")
    del kv
    torch.cuda.empty_cache()
    return [
        figure(name, num_tokens / best_s, "tok/s", None, None, notes),
        figure(f"{name} matrix rate", achieved_tflop_s, "TFLOP/s",
               ctx.limits["matmul_bf16_tflop_s"], PREFILL_TARGET, notes),
    ]
