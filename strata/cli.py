"""The `strata` command: generate, info, pull, serve."""

from __future__ import annotations

import argparse
import sys

from strata import __version__


def _model_path(arg: str | None) -> str:
    """The model to use: the one given, else the embedded default (fetched on first use)."""
    if arg:
        return arg
    from strata.default_model import default_model_path

    return str(default_model_path(fetch=True))


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
    from strata.engine.core.model_info import format_model_info
    from strata.engine.core.loader import inspect_model

    print(format_model_info(inspect_model(_model_path(args.model))))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from strata.default_model import pull_default_model

    print(pull_default_model())
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from strata.engine.service.serve import serve_from_args

    return serve_from_args(args)


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
    info.set_defaults(func=cmd_info)

    pull = sub.add_parser("pull", help="fetch the embedded default model (SmolLM2-135M)")
    pull.set_defaults(func=cmd_pull)

    serve = sub.add_parser("serve", help="run the OpenAI/Anthropic-compatible server")
    try:
        from strata.engine.service.settings import add_serve_arguments

        add_serve_arguments(serve)
    except ImportError:  # pragma: no cover - the service package is always shipped
        pass
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
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
