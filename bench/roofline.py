"""The quantized-bytes decode roofline of a GGUF file: the bytes one token's decode reads.

Weights as stored in the file (blocks, not their bf16 size): every tensor but the token
embedding (a token reads one row of it, unless the head is tied to it); of the stacked experts
(ffn_*_exps) only expert_used_count of expert_count. The K/V of a short context is left out:
at the benchmark's context it is well under 1% of the weights.
"""

from __future__ import annotations


def decode_weight_bytes(reader) -> dict:
    """{total_bytes, expert_bytes, per_token_bytes, experts_used_fraction} of a GGUF file
    (a strata.engine.gguf_reader.GGUFFile)."""
    arch = reader.metadata.get("general.architecture")
    num_experts = int(reader.metadata.get(f"{arch}.expert_count") or 0)
    num_used = int(reader.metadata.get(f"{arch}.expert_used_count") or 0)
    fraction = num_used / num_experts if num_experts else 1.0
    names = {t.name for t in reader.tensors}
    total = experts = per_token = 0
    for tensor in reader.tensors:
        total += tensor.n_bytes
        if tensor.name == "token_embd.weight" and "output.weight" in names:
            continue
        if "_exps." in tensor.name:
            experts += tensor.n_bytes
            per_token += tensor.n_bytes * fraction
        else:
            per_token += tensor.n_bytes
    return {"total_bytes": total, "expert_bytes": experts, "per_token_bytes": int(per_token),
            "experts_used_fraction": fraction}
