"""ServeSettings: TOML file + command-line overrides, and the one-line errors for bad input."""

from __future__ import annotations

import argparse

import pytest

from strata.engine.service.settings import (
    GIB,
    ServeSettings,
    SettingsError,
    add_serve_arguments,
    load_settings,
    overrides_from_args,
    parse_bytes,
)


def write(tmp_path, text: str):
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_defaults_are_the_documented_ones():
    settings = ServeSettings()
    assert (settings.host, settings.port, settings.device) == ("127.0.0.1", 8080, "auto")
    assert settings.model is None and settings.api_key is None and settings.context_tokens == 0
    assert settings.sleep_idle_s is None and settings.vram_wait_s == 15.0
    assert settings.expert_cache == "auto" and settings.before_load is None


def test_file_values_and_overrides_that_win(tmp_path):
    path = write(tmp_path, """
port = 9000
host = "0.0.0.0"
context-tokens = 2048
cache-release-idle = 30          # the flag's name works too
sleep_idle_s = 600
before-load = ["curl", "-X", "POST", "http://127.0.0.1:8188/free"]
snapshot-ram-budget = "2GiB"
snapshot_disk_budget_bytes = 1000
expert-cache = 12

[rules]                          # the tray's section: not the server's business
comfyui = true
""")
    settings = load_settings(path, {"port": 9100, "host": None, "sleep_idle_s": 0,
                                    "device": "cpu"})
    assert settings.port == 9100  # the override wins
    assert settings.host == "0.0.0.0"  # None overrides nothing
    assert settings.sleep_idle_s is None  # 0 turns the file's timer off
    assert settings.device == "cpu" and settings.context_tokens == 2048
    assert settings.cache_release_idle_s == 30.0
    assert settings.before_load == ("curl", "-X", "POST", "http://127.0.0.1:8188/free")
    assert settings.before_load_argv[0] == "curl"
    assert settings.snapshot_ram_budget_bytes == 2 * GIB
    assert settings.snapshot_disk_budget_bytes == 1000 and settings.expert_cache == 12


def test_unknown_key_names_the_key_and_the_file(tmp_path):
    path = write(tmp_path, 'port = 8080\nsleep_idle = 5\nmodle = "x.gguf"\n')
    with pytest.raises(SettingsError) as error:
        load_settings(path, {})
    message = str(error.value)
    assert "'modle'" in message and str(path) in message and "\n" not in message


def test_wrong_types_are_one_line_errors(tmp_path):
    path = write(tmp_path, 'port = "8080"\n')
    with pytest.raises(SettingsError, match=r"config\.toml: 'port' must be an integer, got '8080'"):
        load_settings(path, {})
    for text in ("persist-sessions = 1", "sleep-idle = 'soon'", "device = 'tpu'",
                 "before-load = []", "snapshot-ram-budget = '4 lots'", "port = 70000"):
        with pytest.raises(SettingsError) as error:
            load_settings(write(tmp_path, text + "\n"), {})
        assert "\n" not in str(error.value)
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(write(tmp_path, "port = = 1\n"), {})
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(tmp_path / "missing.toml", {})
    with pytest.raises(SettingsError, match="'port' must be an integer"):
        ServeSettings(port=True)


def test_no_config_file_reads_the_standard_one_when_present(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CONFIG", str(tmp_path / "absent.toml"))
    assert load_settings(None, {}) == ServeSettings()
    monkeypatch.setenv("STRATA_CONFIG", str(write(tmp_path, "port = 1234\n")))
    assert load_settings(None, {}).port == 1234


def test_command_line_flags_override_only_when_given(tmp_path):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    path = write(tmp_path, "port = 9000\npersist-sessions = true\nvram-wait = 3\n")
    args = parser.parse_args(["--config", str(path), "--context", "512", "--sleep-idle", "90",
                              "--no-persist-sessions", "--snapshot-disk-budget", "1GB",
                              "--before-load", "notify-send 'freeing VRAM'", "--api-key", "k"])
    settings = load_settings(args.config, overrides_from_args(args))
    assert settings.port == 9000 and settings.vram_wait_s == 3.0  # from the file
    assert settings.context_tokens == 512 and settings.sleep_idle_s == 90.0
    assert settings.persist_sessions is False and settings.api_key == "k"
    assert settings.snapshot_disk_budget_bytes == 1_000_000_000
    assert settings.before_load_argv == ["notify-send", "freeing VRAM"]
    bare = parser.parse_args([])
    assert all(value is None for value in vars(bare).values())
    with pytest.raises(SystemExit):
        parser.parse_args(["--sleep-idle", "soon"])


def test_byte_sizes():
    assert parse_bytes("512MiB") == 512 * 1024**2
    assert parse_bytes("4 GiB") == 4 * GIB and parse_bytes("2G") == 2 * GIB
    assert parse_bytes("2GB") == 2_000_000_000 and parse_bytes(1024) == 1024
    with pytest.raises(ValueError):
        parse_bytes("-1GiB")


def test_allowed_hosts_and_origins_from_the_file_and_flags(tmp_path):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    path = write(tmp_path, 'allowed-hosts = ["host.docker.internal", "fe80::1"]\n'
                           'allowed_origins = ["https://chat.example.com"]\n')
    settings = load_settings(path, {})
    assert settings.allowed_hosts == ("host.docker.internal", "fe80::1")
    assert settings.allowed_origins == ("https://chat.example.com",)
    args = parser.parse_args(["--config", str(path), "--allowed-hosts", "a.lan, b.lan,a.lan",
                              "--allowed-origins", "http://10.0.0.5:*,app://*,null"])
    settings = load_settings(args.config, overrides_from_args(args))
    assert settings.allowed_hosts == ("a.lan", "b.lan")  # the flag wins; duplicates go
    assert settings.allowed_origins == ("http://10.0.0.5:*", "app://*", "null")


@pytest.mark.parametrize("key,value,needle", [
    ("allowed_hosts", ["http://a.lan"], "bare host name"),
    ("allowed_hosts", ["a.lan:8080"], "bare host name"),
    ("allowed_hosts", [3], "list of strings"),
    ("allowed_origins", ["chat.example.com"], "must be an origin"),
    ("allowed_origins", ["http://a b"], "contains a space"),
])
def test_bad_allowed_hosts_and_origins_are_refused(key, value, needle):
    with pytest.raises(SettingsError, match=needle):
        ServeSettings(**{key: value})
