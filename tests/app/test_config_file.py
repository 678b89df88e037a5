"""The small TOML writer: what it writes, tomllib reads back unchanged."""

from __future__ import annotations

import tomllib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.engine.service.config_file import ConfigFileError, dumps, read_config, write_config

scalars = st.one_of(
    st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(), st.floats(allow_nan=False)
)
keys = st.text(min_size=1, max_size=12)


@given(
    st.dictionaries(keys, st.one_of(scalars, st.lists(st.text(), max_size=3)), max_size=6),
    st.lists(st.dictionaries(keys, scalars, max_size=4), max_size=3),
)
def test_dumps_round_trips(flat, rules):
    config = {**flat}
    if rules and all(rules):
        config["rules"] = rules
    if "rules" in flat and not (rules and all(rules)):
        config["rules"] = flat["rules"]
    assert tomllib.loads(dumps(config)) == config


def test_tables_and_none(tmp_path):
    path = tmp_path / "sub" / "config.toml"
    write_config(
        path,
        {
            "port": 1,
            "api_key": None,
            "tray": {"rules_enabled": False},
            "rules": [{"name": "a", "patterns": ["*x*"]}],
        },
    )
    assert read_config(path) == {
        "port": 1,
        "tray": {"rules_enabled": False},
        "rules": [{"name": "a", "patterns": ["*x*"]}],
    }
    assert not (tmp_path / "sub" / "config.toml.tmp").exists()


def test_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigFileError, match="cannot write a object"):
        dumps({"x": object()})
    bad = tmp_path / "bad.toml"
    bad.write_text("port = = 3\n")
    with pytest.raises(ConfigFileError, match="is not valid TOML"):
        read_config(bad)
    assert read_config(tmp_path / "missing.toml") == {}
