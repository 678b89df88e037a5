"""The tray's fake pool (tests/app/fakes.FakePool) against the real ModelPool, side by side:
the same status keys and types (status_schema.PoolStatus, ModelRow), so the Models menu and
the dashboard's table read nothing only the fake makes (STYLE 17). The real pool runs the real
Service, Supervisor and engine process loop with the fake engine; a second model sits in its
models directory, unloaded."""

from __future__ import annotations

import asyncio

import pytest
from fakes.fake_engine import FAKE_ENGINE_FACTORY, FakeEngineConfig

from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from tests.app.fakes import FakePool
from tests.helpers.status_shape import shape_problems
from tests.text.spm_gguf import write_spm_gguf

# The pool arrives with issue 24's model pool (h-pool); until then there is nothing to compare.
model_pool = pytest.importorskip("strata.engine.service.model_pool")
status_schema = pytest.importorskip("strata.engine.service.status_schema")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def real_pool_status(tmp_path_factory, tiny_model_dir) -> dict:
    models_dir = tmp_path_factory.mktemp("library")
    write_spm_gguf(models_dir / "second.gguf")  # listed, never loaded

    def make_service(settings, **options):
        return Service(settings, engine_factory=FAKE_ENGINE_FACTORY,
                       engine_config=FakeEngineConfig(model_path=str(tiny_model_dir)),
                       **options)

    settings = ServeSettings(model=str(tiny_model_dir), device="cpu", context_tokens=256,
                             models_dir=str(models_dir),
                             snapshot_dir=str(tmp_path_factory.mktemp("snapshots")))

    async def run() -> dict:
        pool = model_pool.ModelPool(settings, service_factory=make_service)
        await pool.start()
        try:
            return pool.status()
        finally:
            await pool.stop()

    return asyncio.run(run())


def test_the_real_pool_has_the_schema_and_lists_the_second_model(real_pool_status):
    assert shape_problems(real_pool_status, status_schema.PoolStatus) == []
    rows = {row["name"]: row for row in real_pool_status["models"]}
    assert real_pool_status["models"][0]["is_default"]  # the default first
    assert rows["second"]["state"] == "available" and not rows["second"]["is_default"]


def test_the_fake_pool_has_the_real_keys_and_types(real_pool_status):
    fake = FakePool(library=("qwen-0.5b",))
    for name, status in {"loaded": fake.status(),
                         "sleeping": FakePool(library=("a",), state="sleeping").status(),
                         "unloaded": FakePool(state="unloaded").status()}.items():
        assert shape_problems(status, status_schema.PoolStatus) == [], name
        assert set(status) == set(real_pool_status), name
    real_row_keys = set(real_pool_status["models"][0])
    for row in fake.status()["models"]:
        assert set(row) == real_row_keys
        assert shape_problems(row, status_schema.ModelRow) == []
