"""The before-load hook, alone and before the service's loads and wakes."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from fakes.fake_engine import expected_tokens
from fakes.services import answer, make_service

from strata.engine.service.before_load import BeforeLoadHook, command_argv
from strata.engine.service.facade import ServiceError

pytestmark = pytest.mark.timeout(120)

PROMPT = (61, 62)


def python_hook(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def recording_hook(path) -> list[str]:
    """Appends "<time> <STRATA_BEFORE>" to path each time it runs."""
    return python_hook(
        "import os, sys, time\n"
        f"open({str(path)!r}, 'a').write(f'{{time.time()}} {{os.environ[\"STRATA_BEFORE\"]}}\\n')"
    )


def test_a_command_line_is_split_like_a_shell_without_running_one():
    assert command_argv("curl -X POST 'http://127.0.0.1:8188/free' -d '{\"a\": 1}'") == [
        "curl", "-X", "POST", "http://127.0.0.1:8188/free", "-d", '{"a": 1}']
    assert command_argv(["a b", "c"]) == ["a b", "c"]
    assert command_argv(None) is None and command_argv("  ") is None


def test_on_windows_a_command_line_is_split_by_the_c_runtime_rules(monkeypatch):
    """POSIX rules ate the backslashes of Windows paths; the C runtime's keep them."""
    import subprocess

    from strata.engine.service import before_load

    monkeypatch.setattr(before_load, "_is_windows", lambda: True)
    line = (r'"C:\Program Files\ComfyUI\free.exe" --url http://127.0.0.1:8188/free '
            r'C:\Tools\a\b -d "{\"a\": 1}"')
    argv = command_argv(line)
    assert argv == [r"C:\Program Files\ComfyUI\free.exe", "--url", "http://127.0.0.1:8188/free",
                    r"C:\Tools\a\b", "-d", '{"a": 1}']
    # What subprocess hands CreateProcess parses back to the same argv in the child.
    assert before_load.split_command(subprocess.list2cmdline(argv)) == argv


def test_a_command_line_with_an_unbalanced_quote_is_refused_in_the_settings():
    from strata.engine.service.settings import ServeSettings, SettingsError

    with pytest.raises(SettingsError, match=r"'before_load'.*not a command line"):
        ServeSettings(before_load="curl 'http://127.0.0.1:8188/free")


async def test_a_timeout_kills_what_the_command_started_without_process_groups(
    monkeypatch, tmp_path
):
    """Windows has no killpg: the command's descendants are found by parent id and killed."""
    import os

    import psutil

    monkeypatch.delattr(os, "killpg", raising=False)  # already gone under Windows emulation
    pid_file = tmp_path / "grandchild.pid"
    hook = BeforeLoadHook(python_hook(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)"), timeout_s=2.0)
    result = await hook.run("load")
    assert not result.ok and "timed out" in result.error
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE:
                break  # killed, waiting for a reaper that a container may not have
        except psutil.NoSuchProcess:
            break
        await asyncio.sleep(0.05)
    else:
        psutil.Process(grandchild).kill()
        pytest.fail("the command's child outlived the timeout")


async def test_the_hook_reports_success_failure_timeout_and_a_missing_command(tmp_path):
    ok = BeforeLoadHook(recording_hook(tmp_path / "ran"))
    result = await ok.run("wake")
    assert result.ok and result.rc == 0 and result.error is None and result.s >= 0
    assert (tmp_path / "ran").read_text().split()[1] == "wake"
    assert ok.status() == {"ok": True, "rc": 0, "s": result.s, "error": None, "reason": "wake"}

    failing = await BeforeLoadHook(python_hook(
        "import sys; print('ComfyUI is not running', file=sys.stderr); sys.exit(3)")).run("load")
    assert not failing.ok and failing.rc == 3
    assert failing.error == "exited with code 3: ComfyUI is not running"

    started_s = time.monotonic()
    slow = await BeforeLoadHook(python_hook("import time; time.sleep(30)"),
                                timeout_s=0.3).run("load")
    assert time.monotonic() - started_s < 5
    assert not slow.ok and slow.rc is None and "timed out after 0.3 s" in slow.error

    missing = await BeforeLoadHook("/no/such/command --flag").run("load")
    assert not missing.ok and missing.error.startswith("could not start")

    with pytest.raises(ServiceError) as refused:
        await BeforeLoadHook(python_hook("raise SystemExit(2)"), is_required=True).run("load")
    assert (refused.value.status, refused.value.code) == (503, "before_load_failed")
    assert "exited with code 2" in refused.value.message
    assert await BeforeLoadHook(None).run("load") is None


async def test_the_hook_runs_before_the_engine_starts_and_before_each_wake(tiny_model_dir, tmp_path):
    log = tmp_path / "hook.log"
    service = make_service(tiny_model_dir, before_load=recording_hook(log))
    await service.start()
    try:
        (hook_s, reason), = [line.split() for line in log.read_text().splitlines()]
        info = service.status()["engine"]["model_info"]
        # The engine process began importing, and the engine was built, after the hook ran.
        assert reason == "load" and float(hook_s) < info["module_imported_at_s"]
        assert float(hook_s) < info["constructed_at_s"]
        assert service.status()["last_hook"]["ok"] is True

        await service.control("sleep")
        await service.control("wake")
        assert [line.split()[1] for line in log.read_text().splitlines()] == ["load", "wake"]
        await service.control("unload")
        await answer(service, PROMPT)  # an on-demand load runs it too
        assert log.read_text().splitlines()[-1].split()[1] == "load"
        assert service.status()["last_hook"]["reason"] == "load"
    finally:
        await service.stop()


async def test_a_failing_or_slow_hook_does_not_block_unless_required(tiny_model_dir):
    service = make_service(tiny_model_dir, before_load=python_hook("raise SystemExit(4)"))
    await service.start()
    try:
        assert service.status()["state"] == "loaded"
        assert service.status()["last_hook"]["rc"] == 4
    finally:
        await service.stop()

    slow = make_service(tiny_model_dir, before_load=python_hook("import time; time.sleep(30)"),
                        before_load_timeout_s=0.3)
    await slow.start()
    try:
        assert slow.status()["state"] == "loaded"
        assert "timed out" in slow.status()["last_hook"]["error"]
    finally:
        await slow.stop()

    required = make_service(tiny_model_dir, before_load=python_hook("raise SystemExit(4)"),
                            before_load_required=True)
    await required.start()
    try:
        status = required.status()
        assert status["state"] == "unloaded" and status["engine_starts"] == 0
        assert "exited with code 4" in status["last_error"]
        with pytest.raises(ServiceError) as refused:
            await answer(required, PROMPT)
        assert (refused.value.status, refused.value.code) == (503, "before_load_failed")
        assert required.status()["engine_starts"] == 0  # the engine never started
    finally:
        await required.stop()


async def test_a_required_hook_that_succeeds_lets_the_load_through(tiny_model_dir, tmp_path):
    service = make_service(tiny_model_dir, before_load=recording_hook(tmp_path / "ok.log"),
                           before_load_required=True)
    await service.start()
    try:
        ids, _ = await answer(service, PROMPT)
        assert ids == expected_tokens(PROMPT, 6)
    finally:
        await service.stop()


def test_on_windows_the_hook_starts_without_a_console_window(monkeypatch):
    """The tray runs windowless (pythonw): a console hook (curl.exe) flashed a console window
    per load. CREATE_NO_WINDOW is Windows' value (subprocess has it only there); POSIX keeps
    its own session, which the timeout's process-group kill needs."""
    from strata.engine.service import before_load

    assert before_load.spawn_options() == {"start_new_session": True}
    monkeypatch.setattr(before_load, "_is_windows", lambda: True)
    assert before_load.spawn_options() == {"creationflags": 0x08000000}
    assert "start_new_session" not in before_load.spawn_options()
