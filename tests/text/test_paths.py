"""Where Strata keeps its files: environment overrides first, then XDG, then home defaults."""

from pathlib import Path

from strata import paths


def test_strata_home_env_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "h"))
    assert paths.strata_home() == tmp_path / "h"
    assert paths.model_cache_dir() == tmp_path / "h" / "models"
    assert paths.snapshot_dir() == tmp_path / "h" / "snapshots"


def test_xdg_and_home_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("STRATA_HOME", raising=False)
    monkeypatch.delenv("STRATA_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    assert paths.strata_home() == tmp_path / ".local/share/strata"
    assert paths.config_path() == tmp_path / ".config/strata/config.toml"
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/ignored")  # XDG: relative values are ignored
    assert paths.strata_home() == tmp_path / "data" / "strata"
    assert paths.config_path() == tmp_path / ".config/strata/config.toml"


def test_config_env_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_CONFIG", str(tmp_path / "c.toml"))
    assert paths.config_path() == tmp_path / "c.toml"


def test_paths_do_not_create_directories(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "nothing"))
    paths.model_cache_dir(), paths.snapshot_dir()
    assert not Path(tmp_path / "nothing").exists()


def test_kernel_cache_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert paths.kernel_cache_dir() == tmp_path / ".cache/strata/kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    assert paths.kernel_cache_dir() == tmp_path / "c" / "strata" / "kernels"


def test_windows_uses_the_known_folders(monkeypatch):
    """On Windows: data, cache and logs in %LOCALAPPDATA%\\Strata, config in %APPDATA%\\Strata."""
    import ntpath

    from platformdirs import windows

    # On Linux platformdirs cannot ask the shell; resolve from the environment, as its own
    # fallback does on Windows without ctypes.
    monkeypatch.setattr(windows, "_RESOLVE_WIN_FOLDER", windows.get_win_folder_from_env_vars)
    monkeypatch.setattr(paths, "_is_windows", lambda: True)
    monkeypatch.setenv("LOCALAPPDATA", r"C:\Users\ann\AppData\Local")
    monkeypatch.setenv("APPDATA", r"C:\Users\ann\AppData\Roaming")
    for name in ("STRATA_HOME", "STRATA_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    def windows_path(path: Path) -> str:  # platformdirs joins with os.sep, "/" on Linux
        return ntpath.normpath(str(path))

    local = r"C:\Users\ann\AppData\Local\Strata"
    assert windows_path(paths.strata_home()) == local
    assert windows_path(paths.model_cache_dir()) == local + r"\models"
    assert windows_path(paths.config_path()) == r"C:\Users\ann\AppData\Roaming\Strata\config.toml"
    assert windows_path(paths.log_dir()) == local + r"\Logs"
    assert windows_path(paths.kernel_cache_dir()) == local + r"\Cache\kernels"
    monkeypatch.setenv("STRATA_HOME", "/elsewhere")  # the override still wins
    assert paths.strata_home() == Path("/elsewhere")


def test_linux_log_dir_is_the_xdg_state_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    assert paths.log_dir() == tmp_path / ".local/state/strata/logs"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "s"))
    assert paths.log_dir() == tmp_path / "s" / "strata" / "logs"
