"""The `strata` command: generate, info, pull, list, rm, serve, bench."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from strata import __version__
from strata.errors import StrataError


def _model_path(arg: str | None) -> str:
    from strata.default_model import resolve_model_path

    if arg is not None and not Path(arg).expanduser().exists():
        raise StrataError(f"model {arg} not found: pass a .gguf file or a Hugging Face "
                          "directory, or leave --model out for the default model")
    if arg is not None:  # a FIFO or a device: opening it would block (issue 51)
        from strata.engine.gguf_file import model_path_problem

        problem = model_path_problem(Path(arg).expanduser())
        if problem is not None:
            raise StrataError(problem)
    return resolve_model_path(arg)


def cmd_generate(args: argparse.Namespace) -> int:
    from strata.engine.core.engine import Engine
    from strata.engine.protocol import SamplingSpec
    from strata.engine.service.settings import engine_config_for, settings_from_config
    from strata.engine.text import IncrementalDetokenizer, load_text_assets

    model_path = _model_path(args.model)
    assets = load_text_assets(model_path)  # TextAssetsError: one line, no traceback
    # An instruct model given a bare prompt mostly ends the turn at once (a blank line), so
    # the chat template is the default wherever the model has one; --raw continues the text.
    is_chat = not args.raw and (args.chat or bool(assets.chat_template))
    if is_chat:
        prompt_ids = assets.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = assets.encode(args.prompt)
    engine = Engine(engine_config_for(settings_from_config({}, {"device": args.device}),
                                      model_path))
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
    text = []
    for ids in engine.generate(prompt_ids, spec):
        text.append(detok.push(ids))
        sys.stdout.write(text[-1])
        sys.stdout.flush()
    text.append(detok.flush())
    sys.stdout.write(text[-1] + "\n")
    usage = engine.last_usage
    if not "".join(text).strip():  # say why the line is blank rather than leave a puzzle
        print(f"strata: the model produced no text ({usage.completion_tokens if usage else 0} "
              f"token(s), finish: {usage.finish_reason if usage else 'unknown'})"
              + ("" if is_chat else "; it continues raw text: try --chat"),
              file=sys.stderr)
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

    print(format_model_info(inspect_model(_model_path(args.model), args.context_tokens)))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    if not args.model:
        from strata.default_model import pull_default_model

        print(pull_default_model())
        return 0
    from strata.library.pull import pull

    print(pull(args.model, _library_dir(args)))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from strata.library.catalog import scan
    from strata.library.table import format_table

    print(format_table(scan(_library_dir(args))))
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from strata.library.catalog import remove

    entry = remove(args.model, _library_dir(args))
    print(f"removed {entry.name} ({entry.path})")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from strata.host.serve import serve_from_args

    return serve_from_args(args)


def cmd_bench(bench_args: list[str]) -> int:
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

    # The suite's whole docstring: its first line alone stopped mid-sentence.
    parser = argparse.ArgumentParser(prog="strata bench", description=suite.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    suite.add_bench_arguments(parser)
    suite.run_bench(parser.parse_args(bench_args))
    return 0


def _models_dir_argument(parser: argparse.ArgumentParser) -> None:
    from pathlib import Path

    parser.add_argument("--models-dir", type=Path, default=None,
                        help="the model library (default: the server's: $STRATA_MODELS_DIR, "
                             "else the config file's models-dir, else STRATA_HOME/models)")


def _library_dir(args: argparse.Namespace) -> Path:
    """The directory `strata serve` would serve models from, so pull, list and rm work on
    the same library: the flag, else the settings' (environment, config file, default)."""
    if args.models_dir is not None:
        return args.models_dir
    from strata.engine.service.settings import load_settings

    return load_settings(None, {}).library_dir


def build_parser() -> argparse.ArgumentParser:
    # The server's flags, and those the other commands share with it, come from the settings
    # schema (torch-free, cheap to import).
    from strata.engine.service.settings import add_serve_arguments, add_setting_argument

    parser = argparse.ArgumentParser(prog="strata", description=__doc__)
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream an answer to a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="a .gguf file or a Hugging Face directory")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true",
                      help="wrap the prompt in the chat template (the default when the model "
                      "has one; ChatML when it has none)")
    mode.add_argument("--raw", action="store_true",
                      help="continue the prompt as raw text, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    add_setting_argument(gen, "device", default="auto")
    gen.add_argument("-v", "--verbose", action="store_true")
    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser("info", help="describe a model file")
    info.add_argument("model", nargs="?")
    add_setting_argument(info, "context_tokens", default=0, help="context for the VRAM "
                         "estimate (default: the model's, capped at 8192)")
    info.set_defaults(func=cmd_info)

    pull = sub.add_parser("pull", help="fetch a model from the Hugging Face hub (HF_ENDPOINT, "
                          "HF_TOKEN), or the embedded default model (SmolLM2-135M)")
    pull.add_argument("model", nargs="?", metavar="REPO[:FILE]",
                      help="e.g. bartowski/Qwen_Qwen3-8B-GGUF:Q4_K_M (a quantization or a "
                      ".gguf name) or an HF directory's repo; none: the default model")
    _models_dir_argument(pull)
    pull.set_defaults(func=cmd_pull)

    listing = sub.add_parser("list", help="the models in the library")
    _models_dir_argument(listing)
    listing.set_defaults(func=cmd_list)

    rm = sub.add_parser("rm", help="delete a model from the library")
    rm.add_argument("model", help="its name, as `strata list` shows it")
    _models_dir_argument(rm)
    rm.set_defaults(func=cmd_rm)

    bench = sub.add_parser(
        "bench", help="GPU speed suite against measured limits and a peer (see bench/suite.py)",
        add_help=False,
    )
    bench.set_defaults(func=None)  # main() hands everything after `bench` to the suite

    serve = sub.add_parser("serve", help="run the OpenAI/Anthropic-compatible server")
    add_serve_arguments(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def _never_fail_on_encoding() -> None:
    """A pipe or console whose encoding lacks a character (cp1252 on Windows) gets '?' for it
    instead of a UnicodeEncodeError that ends the command mid-answer."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # absent on a replaced stream
        if reconfigure is not None:
            reconfigure(errors="replace")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _never_fail_on_encoding()
    parser = build_parser()
    is_bench = bool(argv) and argv[0] == "bench"
    args = None if is_bench else parser.parse_args(argv)
    try:
        return cmd_bench(argv[1:]) if args is None else args.func(args)
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
