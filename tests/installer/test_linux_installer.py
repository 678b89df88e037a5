"""installer/linux/install.sh end to end, into a temporary prefix with every XDG folder in tmp:
install from the checkout, run the installed `strata`, then uninstall and find nothing left."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from install_helpers import REPO_ROOT, base_python, isolated_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(sys.platform != "linux", reason="the Linux installer")]
INSTALL_SH = REPO_ROOT / "installer" / "linux" / "install.sh"


def run_installer(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", str(INSTALL_SH), *args], env=env, check=False,
                            capture_output=True, text=True, timeout=400, cwd=env["HOME"])
    assert result.returncode == 0, f"install.sh {' '.join(args)} failed:\n{result.stderr[-3000:]}"
    return result


def desktop_file_valid(path: Path) -> None:
    if shutil.which("desktop-file-validate") is None:
        pytest.skip("desktop-file-validate is missing (apt install desktop-file-utils)")
    check = subprocess.run(["desktop-file-validate", str(path)], check=False,
                           capture_output=True, text=True)
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory, source_copy, deps_overlay, default_model_file):
    """One install shared by the tests below: (prefix, env)."""
    tmp = tmp_path_factory.mktemp("linux-install")
    home = tmp / "strata-home"
    home.mkdir()
    # The model cache is reused through STRATA_HOME, so nothing is downloaded again.
    (home / "models").symlink_to(default_model_file.parent, target_is_directory=True)
    env = isolated_env(tmp, deps_overlay, STRATA_SOURCE=str(source_copy), STRATA_HOME=str(home))
    Path(env["HOME"]).mkdir()
    prefix = tmp / "prefix with space"
    result = run_installer(env, "--prefix", str(prefix), "--python", base_python(),
                           "--autostart")
    env["INSTALL_STDOUT"] = result.stdout  # the install's own output, for the torch check
    return prefix, env


def test_template_launcher_is_valid():
    desktop_file_valid(INSTALL_SH.parent / "strata.desktop")


def test_installed_strata_reports_its_version(installed):
    prefix, env = installed
    result = subprocess.run([prefix / "bin" / "strata", "--version"], env=env, check=False,
                            capture_output=True, text=True, timeout=120, cwd=env["HOME"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "strata 0.1.0"
    assert "/lib/strata/venv/" in (prefix / "bin" / "strata").resolve().as_posix()


def test_installed_strata_generates_with_the_default_model(installed):
    prefix, env = installed
    result = subprocess.run([prefix / "bin" / "strata", "generate", "--max-tokens", "4", "-v",
                             "The capital of France is"], env=env, check=False, capture_output=True,
                            text=True, timeout=300, cwd=env["HOME"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip(), "no text generated"
    assert "4 generated" in result.stderr
    assert "downloading" not in result.stderr, "the cached model was not reused"


def test_torch_is_the_pinned_cpu_build_without_an_nvidia_driver(installed):
    prefix, env = installed
    if Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA driver: the installer takes the CUDA build")
    assert ("installing PyTorch 2.13.0, CPU build (no NVIDIA driver found, or --torch cpu; "
            "about 200 MB to download)") in env["INSTALL_STDOUT"]
    version = subprocess.run([prefix / "lib/strata/venv/bin/python", "-c",
                              "import torch; print(torch.__version__)"], env=env, check=True,
                             capture_output=True, text=True, timeout=120).stdout
    assert version.startswith("2.13.0")


def test_launcher_icon_and_autostart_are_installed(installed):
    prefix, env = installed
    launcher = prefix / "share" / "applications" / "strata.desktop"
    desktop_file_valid(launcher)
    text = launcher.read_text()
    assert f'Exec="{prefix}/bin/strata-tray"' in text
    assert (prefix / "share/icons/hicolor/scalable/apps/strata.svg").read_text().startswith("<")
    autostart = Path(env["XDG_CONFIG_HOME"]) / "autostart" / "strata-tray.desktop"
    desktop_file_valid(autostart)
    assert f"{prefix}/bin/strata-tray" in autostart.read_text()


def test_reinstall_replaces_the_install_and_keeps_the_login_entry(installed):
    prefix, env = installed
    stale = prefix / "lib" / "strata" / "venv" / "stale-marker"
    stale.write_text("from the first install")
    result = run_installer(env, "--prefix", str(prefix), "--python", base_python())
    assert "replacing the existing installation" in result.stdout
    assert not stale.exists()
    assert (Path(env["XDG_CONFIG_HOME"]) / "autostart" / "strata-tray.desktop").is_file()
    manifest = (prefix / "lib" / "strata" / "installed-files").read_text().splitlines()
    assert len(manifest) == len(set(manifest)), "the manifest lists files twice"


def test_uninstall_leaves_nothing_in_the_prefix_and_purges_models(installed, tmp_path):
    prefix, env = installed
    # A home of its own with a stand-in model: --purge-models must never reach the real cache.
    home = tmp_path / "purge-home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "stand-in.gguf").write_bytes(b"GGUF")
    purge_env = {**env, "STRATA_HOME": str(home)}
    run_installer(purge_env, "--uninstall", "--purge-models", "--prefix", str(prefix))
    assert not prefix.exists(), "the prefix it created is removed, with no empty folders"
    assert not (home / "models").exists()
    assert home.exists(), "only the model cache is purged"
    assert not (Path(env["XDG_CONFIG_HOME"]) / "autostart").exists()  # nothing else was in it
    assert Path(env["STRATA_HOME"], "models").resolve().is_dir()


def test_bad_arguments_fail_with_one_line(tmp_path):
    result = subprocess.run(["bash", str(INSTALL_SH), "--frobnicate"], check=False,
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert result.stderr.strip() == \
        "install.sh: error: unknown option '--frobnicate'; run install.sh --help"
    result = subprocess.run(["bash", str(INSTALL_SH), "--uninstall", "--prefix", str(tmp_path)],
                            check=False, capture_output=True, text=True)
    assert result.returncode != 0 and "no Strata installation" in result.stderr


def test_help_shows_every_option_and_the_download_sizes():
    result = subprocess.run(["bash", str(INSTALL_SH), "--help"], check=True,
                            capture_output=True, text=True)
    for text in ("--prefix DIR", "--python PY", "--system-site-packages", "--torch auto|cpu|cuda",
                 "--autostart", "--uninstall", "--purge-models", "STRATA_SOURCE",
                 "about 4 GB", "about 200 MB", "survive an uninstall"):
        assert text in result.stdout, text
    assert not result.stdout.startswith("#") and "set -euo" not in result.stdout
