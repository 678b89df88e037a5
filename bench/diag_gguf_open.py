"""What opening a GGUF costs: the `gguf` package's GGUFReader against Strata's reader.

    python bench/diag_gguf_open.py [--model PATH] [--runs 5] [--json diag-gguf-open.json]

Times, each the median of --runs in this process (the file in the page cache, CPU and wall
clock both, since a busy machine inflates wall time): opening the file and reading what the
engine needs (the architecture's config keys and every tensor info), and reading the
tokenizer's metadata (tokens, types, merges) then building the `tokenizers.Tokenizer`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
from report import write_json  # bench/report.py, next to this file

from strata.default_model import default_model_path
from strata.engine.gguf_reader import read_gguf
from strata.engine.text.gguf_tokenizer import GGUFVocab, build_tokenizer

_VOCAB_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def _timed(fn, runs: int) -> dict[str, float]:
    wall, cpu = [], []
    for _ in range(runs):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu)}


def _old_engine_view(path: str) -> None:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.get_field("general.architecture").contents()
    {k: f.contents() for k, f in reader.fields.items() if k.startswith(arch + ".")}
    [(t.name, t.tensor_type, t.shape, t.n_bytes, t.data_offset) for t in reader.tensors]


def _new_engine_view(path: str) -> None:
    gguf_file = read_gguf(path)
    arch = gguf_file.metadata["general.architecture"]
    {k: gguf_file.metadata[k] for k in gguf_file.metadata if k.startswith(arch + ".")}
    [(t.name, t.tensor_type, t.shape, t.n_bytes, t.data_offset) for t in gguf_file.tensors]


def _vocab(get) -> GGUFVocab:
    tokens, types, merges = (get(key) for key in _VOCAB_KEYS)
    return GGUFVocab(
        model=get("tokenizer.ggml.model"), pre=get("tokenizer.ggml.pre"), tokens=tokens,
        token_types=types, scores=[], merges=merges,
        bos_token_id=get("tokenizer.ggml.bos_token_id"),
        eos_token_id=get("tokenizer.ggml.eos_token_id"), eot_token_id=None, eom_token_id=None,
        unknown_token_id=None, add_bos=False, add_eos=False, add_space_prefix=False,
        chat_template=None,
    )


def _old_tokenizer(path: str) -> None:
    import gguf

    reader = gguf.GGUFReader(path)
    build_tokenizer(_vocab(lambda key: reader.get_field(key).contents()))


def _new_tokenizer(path: str) -> None:
    gguf_file = read_gguf(path)
    build_tokenizer(_vocab(lambda key: gguf_file.metadata[key]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    path = str(args.model or default_model_path(fetch=False))
    rows = {
        "open + config keys + tensor infos, gguf.GGUFReader": _timed(
            lambda: _old_engine_view(path), args.runs),
        "open + config keys + tensor infos, strata gguf_reader": _timed(
            lambda: _new_engine_view(path), args.runs),
        "open + vocab + build tokenizer, gguf.GGUFReader": _timed(
            lambda: _old_tokenizer(path), args.runs),
        "open + vocab + build tokenizer, strata gguf_reader": _timed(
            lambda: _new_tokenizer(path), args.runs),
    }
    for name, row in rows.items():
        print(f"{name:58s} {row['wall_s'] * 1e3:9.1f} ms wall {row['cpu_s'] * 1e3:9.1f} ms cpu")
    write_json({"model": path, "runs": args.runs, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
