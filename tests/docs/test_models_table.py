"""docs/models.md against the code: one row per architecture the registry builds, the GGUF
architecture names the loader maps to it, and the fast-path and expert-cache columns against
the models themselves (a tiny model of each family, built on the meta device)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from strata.engine.core.fast_coverage import missing_features
from strata.engine.core.loader.gguf_names import GGUF_ARCHITECTURES
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.registry import model_module, supported_model_types
from strata.engine.core.models.switch import SparseMoE
from tests.helpers.tiny_models import VARIANTS, make_tiny_hf_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
CODE = re.compile(r"`([^`]+)`")


def table_rows() -> dict[str, dict[str, str]]:
    """model_type -> the row's cells by column name."""
    lines = [line for line in DOC.read_text().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        row = dict(zip(header, cells))
        rows[CODE.findall(row["HF `model_type`"])[0]] = row
    return rows


def tiny_model(model_type: str) -> torch.nn.Module:
    variant = next(v for v in VARIANTS if make_tiny_hf_config(v).model_type == model_type)
    config = ModelConfig.from_hf_dict(make_tiny_hf_config(variant).to_dict())
    with torch.device("meta"):
        return model_module(config.model_type).Model(config)


def test_one_row_per_architecture_the_registry_builds():
    assert sorted(table_rows()) == sorted(supported_model_types())


def test_the_gguf_column_names_what_the_loader_maps():
    rows = table_rows()
    for arch, model_type in GGUF_ARCHITECTURES.items():
        assert arch in CODE.findall(rows[model_type]["GGUF `general.architecture`"]), arch
    for model_type, row in rows.items():
        for arch in CODE.findall(row["GGUF `general.architecture`"]):
            assert arch in GGUF_ARCHITECTURES, (model_type, arch)


def test_fast_path_and_expert_cache_columns_match_the_models():
    for model_type, row in table_rows().items():
        model = tiny_model(model_type)
        is_fast = not missing_features(model)
        assert row["Fast CUDA path"].startswith("yes" if is_fast else "no"), (model_type,
                                                                              missing_features(model))
        has_experts = any(isinstance(m, SparseMoE) for m in model.modules())
        assert row["Expert cache"] == ("yes" if has_experts else "no"), model_type
