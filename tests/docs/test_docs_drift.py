"""The README and docs cannot drift from the program where a machine can tell (issue #17 item
25): every flag they mention exists in the command they give it to, the default model's size is
the real file's, the tray menu they list is the real menu, and CI installs and tests with the
README's own developer commands. (Config keys and defaults: test_configuration_doc.py.)"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from doc_examples import DOCS_DIR

from strata.cli import build_parser
from strata.units import MIB

REPO = DOCS_DIR.parent
PAGES = [REPO / "README.md", *sorted(DOCS_DIR.glob("*.md"))]
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_FENCE = re.compile(r"^\s*```")
# Flags of other programs the docs show in their own commands: the program, then its flags.
FOREIGN = {
    "pip": {"--extra-index-url", "--index-url", "--no-deps", "--no-binary"},
    "nvidia-smi": {"--query-compute-apps", "--format"},
    "pytest": {"--dist", "--max-worker-restart", "--durations", "--timeout", "--deselect"},
    "compute-sanitizer": {"--tool", "--report-api-errors"},
}


def _parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def _literal_flags(path: Path) -> set[str]:
    """The "--x" strings of a script (its argparse options, written out literally)."""
    return set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"']", path.read_text(encoding="utf-8")))


def _install_sh_flags() -> set[str]:
    text = (REPO / "installer" / "linux" / "install.sh").read_text(encoding="utf-8")
    return set(re.findall(r"^\s*(?:-h\|)?(--[a-z][a-z0-9-]*)\)", text, re.MULTILINE)) | set(
        re.findall(r"^\s*(--[a-z][a-z0-9-]*)=\*\)", text, re.MULTILINE))


def command_flags() -> dict[str, set[str]]:
    """What each command the docs run accepts: `strata SUB`, strata-tray, scripts."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {f"strata {name}": _parser_flags(sub) for name, sub in subparsers.choices.items()}
    flags["strata"] = _parser_flags(parser)
    flags["strata bench"] = _literal_flags(REPO / "bench" / "suite.py") | {"--help"}
    from strata.app.main import build_parser as tray_parser

    flags["strata-tray"] = _parser_flags(tray_parser())
    flags["install.sh"] = _install_sh_flags()
    for script in (REPO / "bench").glob("*.py"):
        # A bench whose command line grew into its own module keeps it in STEM_args.py.
        args_module = script.with_name(f"{script.stem}_args.py")
        flags[f"bench/{script.name}"] = _literal_flags(script) | {"--help"} | (
            _literal_flags(args_module) if args_module.exists() else set())
    for tool, tool_flags in FOREIGN.items():
        flags[tool] = tool_flags
    return flags


def _command_of(segment: str, known: dict[str, set[str]]) -> str | None:
    """The command a line of shell runs, as a key of `known` (None: not one of ours)."""
    words = segment.replace("python ", "").split()
    for i, word in enumerate(words):
        name = word.rsplit("/", 1)[-1] if word.endswith((".sh", ".py")) else word
        if word.endswith(".py"):
            name = f"bench/{name}"
        if name == "strata" and i + 1 < len(words) and f"strata {words[i + 1]}" in known:
            return f"strata {words[i + 1]}"
        if name in known:
            return name
    return None


def mentions(pages: list[Path]) -> list[tuple[str, str, str | None, str]]:
    """(page, line, command or None, flag) for every --flag of the pages' code."""
    known = command_flags()
    found = []
    for page in pages:
        in_fence, fence_lang = False, ""
        for line in page.read_text(encoding="utf-8").splitlines():
            if _FENCE.match(line):
                in_fence = not in_fence
                fence_lang = line.strip()[3:].strip() if in_fence else ""
                continue
            if fence_lang in ("toml", "json"):  # config values: a flag there is another program's
                continue
            segments = [line] if in_fence else _CODE_SPAN.findall(line)
            for segment in segments:
                for part in re.split(r"[|;]|&&", segment):  # one command per part
                    command = _command_of(part, known)
                    found += [(page.name, line.strip(), command, flag)
                              for flag in _FLAG.findall(part)]
    return found


def flag_problems(pages: list[Path]) -> list[str]:
    """A line per flag that its command lacks (or, outside a command, that nothing has)."""
    known = command_flags()
    anywhere = set().union(*known.values())
    wrong = []
    for page, line, command, flag in mentions(pages):
        if command is not None and flag not in known[command]:
            wrong.append(f"{page}: {command} has no {flag}: {line}")
        elif command is None and flag not in anywhere:
            wrong.append(f"{page}: no command has {flag}: {line}")
    return wrong


def test_every_flag_in_the_docs_exists_where_they_use_it():
    assert flag_problems(PAGES) == []


def test_the_flag_check_finds_a_wrong_flag(tmp_path):
    page = tmp_path / "probe.md"
    page.write_text("Run `strata generate --sleep-idle 5`, or `--no-such-flag`.\n\n```bash\n"
                    "strata serve --sleep-idle 5 --port 0\n```\n")
    line = "Run `strata generate --sleep-idle 5`, or `--no-such-flag`."
    assert flag_problems([page]) == [
        f"probe.md: strata generate has no --sleep-idle: {line}",
        f"probe.md: no command has --no-such-flag: {line}"]


_UNIT = r"(\d+) ?(MiB|MB|GiB|GB)"
_FILE_SIZE = re.compile(rf"{_UNIT} (?:GGUF|file)\b|GGUF \({_UNIT}\)")
_NAMED_SIZE = re.compile(rf"SmolLM2-135M-Instruct \((?:about |a )?{_UNIT}")


def stated_model_sizes(text: str) -> list[tuple[int, str]]:
    """(number, unit) of every "N MiB GGUF/file" or "GGUF (N MiB)" said of the default model
    (SmolLM2 or "default model" within the 200 characters before it)."""
    text = " ".join(text.split())
    sizes = []
    for match in _FILE_SIZE.finditer(text):
        before = text[max(0, match.start() - 200):match.start()]
        if "SmolLM2" in before or "default model" in before:
            number, unit = (match.group(1), match.group(2)) if match.group(1) else (
                match.group(3), match.group(4))
            sizes.append((int(number), unit))
    sizes += [(int(number), unit) for number, unit in _NAMED_SIZE.findall(text)
              if not any(text[m.start():m.end()].startswith(f"{number} ") for m in
                         _FILE_SIZE.finditer(text))]
    return sizes


def test_the_default_model_size_is_the_real_files(smollm2_gguf):
    size_mib = round(smollm2_gguf.stat().st_size / MIB)
    stated = {page.name: stated_model_sizes(page.read_text(encoding="utf-8")) for page in PAGES}
    assert stated["README.md"] and stated["getting-started.md"]
    wrong = {name: sizes for name, sizes in stated.items()
             if any(size != (size_mib, "MiB") for size in sizes)}
    assert wrong == {}, f"the file is {size_mib} MiB"


def test_the_size_check_reads_the_way_the_docs_say_it():
    assert stated_model_sizes("the default model, SmolLM2-135M-Instruct (about 140 MB\nfile)"
                              ) == [(140, "MB")]
    # the README before issue #17
    assert stated_model_sizes("model, SmolLM2-135M-Instruct (about 140 MB):") == [(140, "MB")]
    assert stated_model_sizes("its GGUF (98 MB) cannot") == []  # no model named before it
    assert stated_model_sizes("SmolLM2's shape: its GGUF (98 MB)") == [(98, "MB")]


def test_the_tray_menu_in_the_docs_is_the_real_menu(qtbot):
    pytest.importorskip("PySide6")
    from strata.app.bridge import ServiceBridge
    from strata.app.tray import TrayController

    class NoHost:
        def set_rules(self, **_):
            pass

    tray = TrayController(ServiceBridge(NoHost()))
    tray.apply_status({"state": "loaded", "memory_kind": "VRAM", "vram": {}})
    real = [a.text() for a in tray.menu.actions() if not a.isSeparator()][1:]  # after status
    text = (DOCS_DIR / "tray.md").read_text(encoding="utf-8")
    section = text[text.index("## Menu"):text.index("## Dashboard")]
    lines = [line[2:].strip() for line in section.splitlines() if line.startswith("- ")]
    assert lines[0].startswith("the status line: the state, the memory held")  # no model
    items = lines[1:]
    documented = [label for item in items for label in re.split(r", ", item)]
    # "Sleep (Wake)": the label now, and in brackets the one it turns into.
    assert [re.sub(r" \(.*\)$", "", label) for label in documented] == real


def _readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_ci_runs_the_readmes_developer_commands_and_users_get_a_plain_install():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    developer = _readme_section("Development and tests")
    commands = [line for line in ci.splitlines() if line.startswith(("pip install",
                                                                       "python -m pytest"))]
    assert len(commands) == 2 and all(command in developer for command in commands)
    quick = _readme_section("Quick start")
    assert "pip install" in quick and "[dev]" not in quick
