"""docs/configuration.md cannot drift from the code: its table lists every `strata serve` flag
(add_serve_arguments), every config key (the settings schema's) and their real defaults, and
its environment table every variable the schema reads."""

from __future__ import annotations

import argparse
import re
import tomllib

import pytest
from doc_examples import DOCS_DIR

from strata.engine.service.rules import RuleConfigError, rule_from_table
from strata.engine.service.settings import (
    SETTINGS,
    ServeSettings,
    SettingsError,
    add_serve_arguments,
    check_setting,
    load_settings,
)

PAGE = DOCS_DIR / "configuration.md"
_CODE = re.compile(r"`([^`]*)`")
_NO_VALUE = "—"


def _table_rows(first_cell_prefix: str) -> list[list[str]]:
    """Rows of the Markdown tables whose first cell starts with first_cell_prefix."""
    rows = []
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        # Escaped pipes (\|) inside a cell are not column breaks.
        cells = [c.strip().replace("\\|", "|")
                 for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if line.startswith("|") and cells[0].startswith(first_cell_prefix):
            rows.append(cells)
    return rows


def _serve_actions() -> dict[str, argparse.Action]:
    """Every option string of `strata serve` -> its argparse action."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return {option: action for action in parser._actions
            for option in action.option_strings if option not in ("-h", "--help")}


def _flag_rows() -> list[tuple[list[str], str, str]]:
    """(flags, config key or '—', default cell) per row of the settings table."""
    rows = []
    for cells in _table_rows("`--"):
        flags = [code.split()[0] for code in _CODE.findall(cells[0])]
        key_codes = _CODE.findall(cells[1])
        rows.append((flags, key_codes[0] if key_codes else cells[1], cells[2]))
    return rows


def _doc_default(cell: str):
    """A default cell: a TOML literal in backticks, or 'unset' (None)."""
    if cell == "unset":
        return None
    (literal,) = _CODE.findall(cell)
    return tomllib.loads(f"value = {literal}")["value"]


def test_the_table_lists_every_flag_and_no_other():
    documented = {flag for flags, _, _ in _flag_rows() for flag in flags}
    actual = set(_serve_actions())
    assert documented - actual == set(), "documented flags that strata serve lacks"
    assert actual - documented == set(), "flags missing from docs/configuration.md"


def test_the_table_lists_every_config_key_once():
    actions = _serve_actions()
    fields_by_key = {}
    for flags, key, _ in _flag_rows():
        if key == _NO_VALUE:
            continue
        field_name = actions[flags[0]].dest
        # The key must be one that the settings loader maps to that same field.
        assert key.replace("-", "_") in (field_name, flags[0][2:].replace("-", "_")), key
        fields_by_key[key] = field_name
    names = sorted(fields_by_key.values())
    assert names == sorted(s.name for s in SETTINGS if s.key is not None), \
        "each setting with a config key needs exactly one row with that key"


@pytest.mark.parametrize("flags,key,cell", [pytest.param(*row, id=row[0][0])
                                           for row in _flag_rows() if row[1] != _NO_VALUE])
def test_documented_default_is_the_real_default(flags, key, cell, tmp_path):
    field_name = _serve_actions()[flags[0]].dest
    default = _doc_default(cell)
    real = getattr(ServeSettings(), field_name)
    assert (None if default is None else check_setting(field_name, default)) == real, \
        f"{key}: docs say {cell}, the code says {real!r}"
    if default is not None:  # the documented key, with that value, loads from a config file
        path = tmp_path / "config.toml"
        path.write_text(f"{key} = {_CODE.findall(cell)[0]}\n", encoding="utf-8")
        assert getattr(load_settings(path, {}), field_name) == real


def test_every_environment_variable_is_documented():
    documented = {code.split("=")[0] for cells in _table_rows("`STRATA_")
                  for code in _CODE.findall(cells[0])}
    expected = {s.env for s in SETTINGS if s.env}
    assert expected - documented == set(), "environment variables missing from the docs"


def test_an_undocumented_key_is_refused(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("sleep-after = 30\n", encoding="utf-8")
    with pytest.raises(SettingsError, match="unknown key 'sleep-after'"):
        load_settings(path, {})


def test_every_documented_rule_key_is_accepted():
    samples = {"preset": "comfyui", "name": "r", "trigger": "process", "pattern": "x*",
               "patterns": ["x*"], "threshold_gib": 1.0, "action": "unload",
               "on_end": "wait", "enabled": False, "rules_enabled": True, "match": "cmdline",
               "ignore": ["Xorg"], "keep_free_mib": 4096}
    rule_rows = [c for c in _table_rows("`[[rules]]`")]
    keys = {k for row in rule_rows for k in _CODE.findall(row[1])}
    assert keys and keys <= set(samples), f"unexpected documented keys {keys - set(samples)}"
    for key in keys:
        table = {"trigger": "process", "pattern": "y*", key: samples[key]}
        if key == "patterns":
            table.pop("pattern")
        if key == "keep_free_mib":
            table["action"] = "shrink_experts"
        try:
            rule_from_table(table)
        except RuleConfigError as exc:
            pytest.fail(f"documented rule key {key!r} is refused: {exc}")
