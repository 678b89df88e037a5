"""llama.cpp's llama-batched-bench as the peer of batch_bench.py (issue 22): aggregate decode
tok/s of N parallel sequences on the same GGUF file.

llama-batched-bench (tools/batched-bench) prefills N separate prompts of -npp tokens, then
generates -ntg tokens for each of them together; with `--output-format jsonl` it prints one
JSON object per N: speed_tg = N * ntg / t_tg is the aggregate decode rate, the figure
batch_bench.py's aggregate_tok_s measures for Strata (tokens after every stream's first).
"""

from __future__ import annotations

import json
import subprocess


def batched_command(binary: str, model_path: str, streams: list[int], prompt_tokens: int,
                    max_tokens: int) -> list[str]:
    """Every layer on the GPU, flash attention, a context that holds every stream's prompt
    and generation twice over (each sequence gets context / max(streams) of it)."""
    context = 2 * max(streams) * (prompt_tokens + max_tokens)
    return [binary, "-m", model_path, "-ngl", "99", "-fa", "1", "-c", str(context),
            "-b", "2048", "-ub", "512", "-npp", str(prompt_tokens), "-ntg", str(max_tokens),
            "-npl", ",".join(str(n) for n in streams), "--output-format", "jsonl"]


def parse_jsonl(output: str) -> dict[int, dict]:
    """{streams: {aggregate_tok_s, prefill_tok_s, ...}} from llama-batched-bench's JSONL lines
    (other log lines around them are skipped)."""
    rows: dict[int, dict] = {}
    for line in output.splitlines():
        line = line.strip()
        if not (line.startswith("{") and '"speed_tg"' in line):
            continue
        record = json.loads(line)
        rows[int(record["pl"])] = {"aggregate_tok_s": record["speed_tg"],
                                   "prefill_tok_s": record["speed_pp"],
                                   "decode_s": record["t_tg"], "raw": record}
    return rows


def run_batched(binary: str, model_path: str, streams: list[int], prompt_tokens: int,
                max_tokens: int, timeout_s: float) -> dict:
    """Run it; {"command", "rows": {streams: ...}} or {"command", "error"}."""
    command = batched_command(binary, model_path, streams, prompt_tokens, max_tokens)
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
        return {"command": " ".join(command), "rows": parse_jsonl(out),
                "error": f"timed out after {timeout_s:.0f} s"}
    rows = parse_jsonl(done.stdout + "\n" + done.stderr)
    result = {"command": " ".join(command), "rows": rows}
    if done.returncode != 0 or not rows:
        result["error"] = f"exit status {done.returncode}: {done.stderr[-600:]}"
    return result


def ratio_rows(strata_rows: list[dict], peer_rows: dict[int, dict]) -> list[dict]:
    """Per stream count: Strata's aggregate decode tok/s over llama.cpp's (target 1.2 at 4
    and 8 streams)."""
    out = []
    for row in strata_rows:
        peer = peer_rows.get(row["streams"])
        if peer is None:
            continue
        ratio = row["aggregate_tok_s"] / peer["aggregate_tok_s"]
        out.append({"streams": row["streams"], "strata_tok_s": row["aggregate_tok_s"],
                    "llamacpp_tok_s": round(peer["aggregate_tok_s"], 1),
                    "strata_over_llamacpp": round(ratio, 2),
                    "target": 1.2 if row["streams"] in (4, 8) else None})
    return out
