"""llama.cpp as a peer of `strata bench`: llama-bench on a random-weight GGUF of a preset.

    python bench/llamacpp_peer.py --llama-bench PATH --model smollm2-135m
        [--prompt-tokens 512] [--prefill-tokens 4096] [--decode-tokens 64] [--work-dir DIR]

Writes the preset as an f16 GGUF (random_gguf.py) into a temporary directory, runs llama-bench
(build it with bench/build_llamacpp.sh) with every layer on the GPU and flash attention on,
over prompts of --prefill-tokens and --prompt-tokens and --decode-tokens generated tokens, and
prints one line `PEER_JSON {...}` as peer_transformers.py does: decode_tok_s, prefill_tok_s,
ttft_ms (the --prompt-tokens prompt's processing time; llama-bench does not sample) and the
llama.cpp build. The GGUF is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # random_gguf.py next to this file
from random_gguf import write_random_gguf

REPETITIONS = 3


def bench_command(args, model_path: Path) -> list[str]:
    """llama-bench's command line: one prompt-processing test per prompt length, one
    generation test, JSON out."""
    return [args.llama_bench, "-m", str(model_path),
            "-p", f"{args.prefill_tokens},{args.prompt_tokens}", "-n", str(args.decode_tokens),
            "-ngl", str(args.gpu_layers), "-fa", "1", "-ub", str(args.ubatch),
            "-b", str(max(args.ubatch, args.prefill_tokens)), "-r", str(REPETITIONS),
            "-o", "json"]


def parse_results(stdout: str, args) -> dict:
    """{decode_tok_s, prefill_tok_s, ttft_ms, llamacpp} from llama-bench's JSON list."""
    tests = json.loads(stdout[stdout.index("["):])
    rate: dict[tuple[int, int], float] = {(t["n_prompt"], t["n_gen"]): t["avg_ts"] for t in tests}
    missing = [key for key in ((args.prefill_tokens, 0), (args.prompt_tokens, 0),
                               (0, args.decode_tokens)) if key not in rate]
    if missing:
        raise ValueError(f"llama-bench gave no result for (prompt, generated) {missing}: {rate}")
    build = tests[0]
    return {
        "decode_tok_s": rate[(0, args.decode_tokens)],
        "prefill_tok_s": rate[(args.prefill_tokens, 0)],
        "ttft_ms": args.prompt_tokens / rate[(args.prompt_tokens, 0)] * 1e3,
        "llamacpp": f"{build.get('build_commit', '?')} (build {build.get('build_number', '?')})",
        "backends": build.get("backends", ""),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bench", required=True, help="the llama-bench binary")
    parser.add_argument("--model", required=True, help="a dense llama preset (smollm2-135m...)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--gpu-layers", type=int, default=99, help="llama-bench -ngl")
    parser.add_argument("--ubatch", type=int, default=2048,
                        help="llama-bench -ub: tokens per compute batch of a prompt")
    parser.add_argument("--work-dir", help="where the temporary GGUF goes (default: /tmp)")
    args = parser.parse_args()
    if shutil.which(args.llama_bench) is None:
        print(f"llamacpp_peer: no llama-bench at {args.llama_bench}; build it with "
              "bench/build_llamacpp.sh", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="strata-llamacpp-peer-", dir=args.work_dir))
    try:
        model_path = work / f"{args.model}.gguf"
        write_random_gguf(args.model, model_path)
        done = subprocess.run(bench_command(args, model_path), capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            print(f"llama-bench failed ({done.returncode}): {done.stderr[-800:]}",
                  file=sys.stderr)
            return 1
        print("PEER_JSON " + json.dumps(parse_results(done.stdout, args)), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
