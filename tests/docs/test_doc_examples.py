"""Every example of the user docs runs: shell commands (`strata ...`, `curl ...`) against a live
`strata serve` with the default model, Python snippets, TOML config files, JSON.

Lifecycle routes answer per the engine's abilities (a dense model has no expert cache to
release), so their examples pass on a 2xx JSON answer or a 4xx/503 JSON error in OpenAI's
shape; every other example must succeed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from urllib.parse import urlsplit

import pytest
from doc_examples import (
    SHELL_LANGS,
    Block,
    Command,
    all_blocks,
    mentions_local_server,
    rewrite_port,
    split_commands,
)
from docs_server import strata_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
LIFECYCLE_PATHS = ("/load", "/unload", "/sleep", "/wake", "/cache/release", "/cache/refill",
                   "/cache/shrink",
                   "/session/offload")
COMMAND_TIMEOUT_S = 600


def _examples() -> list:
    params = []
    for block in all_blocks():
        items = split_commands(block) if block.lang in SHELL_LANGS else [block]
        for n, item in enumerate(items):
            suffix = f"#{n + 1}" if len(items) > 1 else ""
            params.append(pytest.param(item, id=f"{block.where}{suffix}"))
    return params


@pytest.mark.parametrize("example", _examples())
def test_doc_example(example: Block | Command, request):
    block = example.block if isinstance(example, Command) else example
    if block.skip_reason is not None:
        pytest.skip(block.skip_reason)
    if isinstance(example, Command):
        run_command(example, request)
    elif block.lang == "python":
        run_python(block, request)
    elif block.lang == "toml":
        check_toml(block, request.getfixturevalue("tmp_path"))
    elif block.lang == "json":
        json.loads(block.text)


def run_command(command: Command, request) -> None:
    program = command.argv[0]
    if program == "curl":
        run_curl(command, request.getfixturevalue("live_server"),
                 request.getfixturevalue("tmp_path"))
    elif program == "strata" and command.argv[1:2] == ("serve",):
        check_serve_arguments(command)
    elif program == "strata":
        run_strata(command, request.getfixturevalue("docs_env"),
                   request.getfixturevalue("tmp_path"))
    else:
        pytest.fail(f"{command.block.where}: {program!r} is neither `strata` nor `curl`; mark "
                    "the block <!-- docs-test: skip (reason) --> if it cannot run here")


def run_strata(command: Command, env: dict, tmp_path) -> None:
    result = subprocess.run([strata_script(), *command.argv[1:]], env=env, cwd=tmp_path,
                            check=False, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert result.returncode == 0, f"`{command.text}` failed:\n{result.stderr[-2000:]}"
    assert result.stdout.strip(), f"`{command.text}` printed nothing"


def check_serve_arguments(command: Command) -> None:
    """`strata serve ...` examples: the flags parse and the values validate. (The live server
    runs the getting-started one for real; starting one per example would take minutes.)"""
    from strata.cli import build_parser
    from strata.engine.service.settings import ServeSettings, overrides_from_args

    try:
        args = build_parser().parse_args(list(command.argv[1:]))
    except SystemExit:
        pytest.fail(f"{command.block.where}: `{command.text}` does not parse")
    ServeSettings(**{k: v for k, v in overrides_from_args(args).items() if v is not None})


def run_curl(command: Command, server, tmp_path) -> None:
    assert mentions_local_server(command.text), \
        f"{command.block.where}: curl examples must call http://127.0.0.1:8080"
    argv = [rewrite_port(arg, server.port) for arg in command.argv[1:]]
    body_path = tmp_path / "body"
    result = subprocess.run(
        ["curl", "-sS", "--max-time", str(COMMAND_TIMEOUT_S), "-o", str(body_path),
         "-w", "%{http_code} %{content_type}", *argv],
        check=False, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S + 30)
    where = f"{command.block.where}: `{command.text}`"
    assert result.returncode == 0, f"{where}: curl failed: {result.stderr}"
    status_text, _, content_type = result.stdout.partition(" ")
    status, body = int(status_text), body_path.read_text(errors="replace")
    path = next(urlsplit(a).path for a in argv if a.startswith("http"))
    is_lifecycle = path in LIFECYCLE_PATHS or (path.startswith("/slots/") and "-X" in argv)
    if is_lifecycle and (400 <= status < 500 or status == 503):
        error = json.loads(body)["error"]
        assert error["message"] and error["type"] and error["code"], f"{where}: {body}"
        return
    assert 200 <= status < 300, f"{where}: HTTP {status}: {body[:1000]}\n{server.log_tail()}"
    check_body(where, content_type, body)


def check_body(where: str, content_type: str, body: str) -> None:
    if content_type.startswith("application/json"):
        assert isinstance(json.loads(body), (dict, list)), f"{where}: {body[:500]}"
    elif content_type.startswith("text/event-stream"):
        assert '"error"' not in body, f"{where}: the stream failed: {body[-1000:]}"
        assert body.rstrip().endswith("data: [DONE]") or "event: message_stop" in body, \
            f"{where}: the stream did not finish: {body[-500:]}"
    else:
        assert body.strip(), f"{where}: empty {content_type} answer"


def run_python(block: Block, request) -> None:
    code = block.text
    env = None
    if mentions_local_server(code):
        server = request.getfixturevalue("live_server")
        code, env = rewrite_port(code, server.port), server.env
    result = subprocess.run([sys.executable, "-c", code], env=env, check=False, capture_output=True,
                            text=True, timeout=COMMAND_TIMEOUT_S,
                            cwd=request.getfixturevalue("tmp_path"))
    assert result.returncode == 0, f"{block.where} failed:\n{result.stderr[-2000:]}"


def check_toml(block: Block, tmp_path) -> None:
    """A config example loads as Strata's config file: server keys and [[rules]] alike."""
    from strata.engine.service.rules import rules_from_config
    from strata.engine.service.settings import load_settings

    path = tmp_path / "config.toml"
    path.write_text(block.text, encoding="utf-8")
    load_settings(path, {})
    rules_from_config(tomllib.loads(block.text).get("rules", []))
