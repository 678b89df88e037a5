"""The API key need not be on a command line (issue 17 item 3): it comes from the config file or
$STRATA_API_KEY; the --api-key flag still works but is blanked from argv, and child processes
(the before-load hook) do not inherit the key."""

from __future__ import annotations

import json
import sys

from strata.engine.service.before_load import BeforeLoadHook
from strata.engine.service.settings import load_settings
from strata.host.serve import hide_api_key_argument


def test_the_key_comes_from_the_environment_or_the_config_file(tmp_path, monkeypatch):
    config = tmp_path / "config.toml"
    config.write_text('api-key = "from-file"\n', encoding="utf-8")
    monkeypatch.delenv("STRATA_API_KEY", raising=False)
    assert load_settings(config, {}).api_key == "from-file"
    monkeypatch.setenv("STRATA_API_KEY", "from-env")
    assert load_settings(config, {}).api_key == "from-env"
    assert load_settings(config, {"api_key": "from-flag"}).api_key == "from-flag"
    monkeypatch.setenv("STRATA_API_KEY", "  ")  # blank: as if unset
    assert load_settings(config, {}).api_key == "from-file"


def test_the_flag_value_is_blanked_from_argv():
    argv = ["strata", "serve", "--api-key", "s3cret", "--port", "1", "--api-key=other"]
    hide_api_key_argument(argv)
    assert argv == ["strata", "serve", "--api-key", "***", "--port", "1", "--api-key=***"]


async def test_the_before_load_hook_does_not_inherit_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_API_KEY", "s3cret")
    out = tmp_path / "env.json"
    hook = BeforeLoadHook([sys.executable, "-c",
                           f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"])
    result = await hook.run("load")
    assert result is not None and result.ok, result
    env = json.loads(out.read_text())
    assert "STRATA_API_KEY" not in env and env["STRATA_BEFORE"] == "load"
