"""--alias names the served model everywhere a client reads or sends the name."""

from __future__ import annotations

import pytest
from fakes.services import make_service

from strata.engine.api import create_app
from strata.engine.service.settings import ServeSettings, SettingsError

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(("alias", "tagged"), [("coder", "coder:latest"),
                                                ("coder:7b", "coder:7b")])
async def test_the_alias_is_the_models_name(aiohttp_client, tiny_model_dir, alias, tagged):
    service = make_service(tiny_model_dir, alias=alias)
    await service.start()
    try:
        client = await aiohttp_client(create_app(service))
        models = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [alias]
        assert (await client.get(f"/v1/models/{alias}")).status == 200
        tags = await (await client.get("/api/tags")).json()
        assert [m["name"] for m in tags["models"]] == [tagged]
        assert (await (await client.get("/props")).json())["model_alias"] == alias
        for name in (alias, tagged):
            chat = await client.post("/api/chat", json={
                "model": name, "stream": False, "options": {"num_predict": 2},
                "messages": [{"role": "user", "content": "w5 w6"}]})
            assert chat.status == 200, await chat.text()
        old_name = tiny_model_dir.name
        refused = await client.post("/api/chat", json={
            "model": old_name, "messages": [{"role": "user", "content": "w5"}]})
        assert refused.status == 404 and tagged in (await refused.json())["error"]
    finally:
        await service.stop()


def test_an_alias_is_one_word():
    assert ServeSettings(alias="my-model:q4").alias == "my-model:q4"
    with pytest.raises(SettingsError, match="alias"):
        ServeSettings(alias="two words")
