"""Presets against real command lines (with the executable path and working directory each
program really has): what must match, and what must not (editors, log tails, other apps)."""

from __future__ import annotations

import pytest

from strata.engine.service.process_watch import ProcessInfo
from strata.engine.service.rule_match import matches, program
from strata.engine.service.rules import PRESETS, Rule


def proc(exe: str, argv: list[str], cwd: str = "", name: str = "") -> ProcessInfo:
    base = exe.replace("\\", "/").rsplit("/", 1)[-1]
    return ProcessInfo(1234, name or base[:15], exe, " ".join(argv), tuple(argv), cwd)


MUST_MATCH = {
    "comfyui": [
        # git clone, started from its folder
        proc("/usr/bin/python3.11", ["python", "main.py", "--listen"], "/home/me/ComfyUI"),
        proc("/home/me/ComfyUI/venv/bin/python3", ["/home/me/ComfyUI/venv/bin/python",
                                                   "/home/me/ComfyUI/main.py"], "/home/me"),
        # the Windows portable build (run_nvidia_gpu.bat)
        proc(r"C:\ComfyUI_windows_portable\python_embeded\python.exe",
             [r".\python_embeded\python.exe", "-s", r"ComfyUI\main.py",
              "--windows-standalone-build"], r"C:\ComfyUI_windows_portable"),
        # the desktop app's server, and the app itself
        proc(r"C:\Users\me\Documents\ComfyUI\.venv\Scripts\python.exe",
             [r"C:\Users\me\Documents\ComfyUI\.venv\Scripts\python.exe",
              r"C:\Users\me\AppData\Local\Programs\@comfyorgcomfyui-electron\resources\ComfyUI\main.py",
              "--user-directory", r"C:\Users\me\Documents\ComfyUI\user", "--port", "8000"]),
        proc(r"C:\Users\me\AppData\Local\Programs\@comfyorgcomfyui-electron\ComfyUI.exe",
             [r"C:\Users\me\AppData\Local\Programs\@comfyorgcomfyui-electron\ComfyUI.exe"]),
        proc("/Applications/ComfyUI.app/Contents/MacOS/ComfyUI",
             ["/Applications/ComfyUI.app/Contents/MacOS/ComfyUI"]),
        # comfy-cli's install under ~/comfy
        proc("/home/me/comfy/ComfyUI/.venv/bin/python", ["python", "-u", "main.py"],
             "/home/me/comfy/ComfyUI"),
    ],
    "steam": [
        proc("/home/u/.local/share/Steam/steamapps/common/Dota 2 beta/game/bin/linuxsteamrt64/dota2",
             ["/home/u/.local/share/Steam/steamapps/common/Dota 2 beta/game/bin/linuxsteamrt64/dota2",
              "-dota_vulkan"]),
        proc(r"C:\Program Files (x86)\Steam\steamapps\common\Cyberpunk 2077\bin\x64\Cyberpunk2077.exe",
             [r"C:\Program Files (x86)\Steam\steamapps\common\Cyberpunk 2077\bin\x64\Cyberpunk2077.exe"]),
        # a Windows game under Proton: exe is wine's loader, argv[0] the game's path
        proc("/home/u/.local/share/Steam/steamapps/common/Proton 9.0 (Beta)/files/bin/wine64-preloader",
             [r"Z:\home\u\.local\share\Steam\steamapps\common\Elden Ring\Game\eldenring.exe"],
             name="eldenring.exe"),
    ],
    "blender": [
        proc("/opt/blender-4.2.0-linux-x64/blender", ["/opt/blender-4.2.0-linux-x64/blender"]),
        proc("/snap/blender/5088/blender", ["blender", "-b", "scene.blend", "-a"]),
        proc(r"C:\Program Files\Blender Foundation\Blender 4.2\blender.exe",
             [r"C:\Program Files\Blender Foundation\Blender 4.2\blender.exe"]),
    ],
    "sd-webui": [
        # webui.sh runs launch.py with the venv's python from the clone
        proc("/usr/bin/python3.10", ["python3", "launch.py"], "/home/me/stable-diffusion-webui"),
        proc(r"C:\sd\stable-diffusion-webui\venv\Scripts\python.exe",
             [r"C:\sd\stable-diffusion-webui\venv\Scripts\python.exe", "launch.py"],
             r"C:\sd\stable-diffusion-webui"),
        proc("/usr/bin/python3.10", ["python", "webui.py", "--api"],
             "/home/me/stable-diffusion-webui-forge"),
        proc(r"C:\webui_forge_cu121_torch231\system\python\python.exe",
             [r"C:\webui_forge_cu121_torch231\system\python\python.exe", "launch.py"],
             r"C:\webui_forge_cu121_torch231\webui"),
    ],
    "fooocus": [
        proc(r"C:\Fooocus_win64\python_embeded\python.exe",
             [r".\python_embeded\python.exe", "-s", r"Fooocus\entry_with_update.py"],
             r"C:\Fooocus_win64"),
        proc("/usr/bin/python3", ["python", "entry_with_update.py", "--listen"], "/home/me/Fooocus"),
    ],
    "invokeai": [
        proc("/usr/bin/python3.11", ["/home/me/invokeai/.venv/bin/python",
                                     "/home/me/invokeai/.venv/bin/invokeai-web"], "/home/me"),
        proc(r"C:\Users\me\invokeai\.venv\Scripts\invokeai-web.exe",
             [r"C:\Users\me\invokeai\.venv\Scripts\invokeai-web.exe"]),
    ],
}

MUST_NOT_MATCH = [
    proc("/usr/bin/vim.basic", ["vim", "/home/me/ComfyUI/main.py"], "/home/me"),
    proc("/usr/bin/tail", ["tail", "-f", "comfyui.log"], "/home/me/ComfyUI"),
    proc("/usr/share/code/code", ["/usr/share/code/code", "/home/me/ComfyUI"]),
    proc("/usr/bin/less", ["less", "/home/me/stable-diffusion-webui/webui.py"]),
    proc("/usr/bin/git", ["git", "pull"], "/home/me/ComfyUI"),
    proc("/usr/bin/python3", ["python", "-m", "pip", "install", "-r", "requirements.txt"],
         "/home/me/ComfyUI"),
    proc("/usr/bin/python3", ["python", "tools/convert.py", "ComfyUI/main.py"], "/home/me"),
    proc("/usr/bin/grep", ["grep", "-r", "steamapps/common", "/etc"]),
    proc("/usr/bin/steam", ["/usr/bin/steam", "-silent"]),
    proc("/home/u/.local/share/Steam/ubuntu12_64/steamwebhelper",
         ["./steamwebhelper", "-lang=en"]),
    proc("/usr/bin/python3", ["python", "-c", "import blender"]),
    proc("/usr/bin/nautilus", ["nautilus", "/opt/blender-4.2.0-linux-x64"]),
    proc("/usr/bin/python3", ["python3", "/home/me/strata/bench/game.py"], "/home/me"),
]


@pytest.mark.parametrize("key, process", [(k, p) for k, ps in MUST_MATCH.items() for p in ps],
                         ids=lambda v: v if isinstance(v, str) else v.cmdline[:40])
def test_each_preset_matches_what_its_program_really_runs(key, process):
    rule = PRESETS[key]
    assert matches(rule.patterns, process, rule.match), (key, process)


@pytest.mark.parametrize("process", MUST_NOT_MATCH, ids=lambda p: p.cmdline[:40])
def test_no_preset_matches_editors_tails_or_other_programs(process):
    hits = [k for k, r in PRESETS.items() if r.trigger == "process"
            and matches(r.patterns, process, r.match)]
    assert hits == []


def test_each_preset_matches_only_its_own_program():
    for key, processes in MUST_MATCH.items():
        for process in processes:
            hits = {k for k, r in PRESETS.items() if r.trigger == "process"
                    and matches(r.patterns, process, r.match)}
            assert hits == {key}, (key, process.cmdline)


def test_cmdline_matching_is_opt_in_per_rule():
    tail = proc("/usr/bin/tail", ["tail", "-f", "comfyui.log"], "/home/me")
    exe_rule = Rule("c", "process", patterns=("*comfyui*",))
    cmd_rule = Rule("c", "process", patterns=("*comfyui*",), match="cmdline")
    assert not matches(exe_rule.patterns, tail, exe_rule.match)
    assert matches(cmd_rule.patterns, tail, cmd_rule.match)


def test_program_is_the_script_resolved_against_the_cwd_or_the_module():
    assert program(proc("/usr/bin/python3", ["python", "-X", "utf8", "-u", "main.py"],
                        "/srv/ComfyUI")) == "/srv/ComfyUI/main.py"
    assert program(proc("/usr/bin/python3", ["python", "-m", "invokeai.app.run_app"])) == \
        "invokeai.app.run_app"
    assert program(proc("/usr/bin/python3", ["python", "-c", "print(1)"])) == ""
    assert program(proc("/usr/bin/vim", ["vim", "main.py"], "/srv/ComfyUI")) == ""
