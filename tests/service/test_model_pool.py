"""The model pool's parts: the eviction plan (LRU, levels, busy models), the budget arithmetic,
names and the config's [models] tables; then a pool of fake engines (one process each) for the
order in which models go down under a budget and the all-model actions of the rules."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fakes.fake_engine import FAKE_ENGINE_FACTORY, FakeEngineConfig
from fakes.services import answer
from fakes.tiny_model import write_tiny_model_dir

from strata.engine.service.facade import ServiceError
from strata.engine.service.levels import Action, State
from strata.engine.service.model_pool import ModelNotFound, ModelPool
from strata.engine.service.model_pool_evict import (
    Candidate,
    budget_need_bytes,
    free_need_bytes,
    plan_eviction,
)
from strata.engine.service.model_pool_names import (
    ModelsConfigError,
    ModelSpec,
    build_index,
    configured_models,
)
from strata.engine.service.model_pool_size import SLEEPING_GPU_BYTES, MemberSize
from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from strata.engine.service.status_schema import PoolStatus
from strata.library.catalog import ModelEntry
from strata.units import MIB
from tests.helpers.status_shape import shape_problems

# ---- the plan -----------------------------------------------------------------------------


def dense(name: str, held: int, used: float, **kw) -> Candidate:
    return Candidate(name, held, used, after={Action.SLEEP: 0, Action.UNLOAD: 0}, **kw)


def moe(name: str, held: int, experts: int, used: float) -> Candidate:
    return Candidate(name, held, used, after={Action.RELEASE_EXPERTS: held - experts,
                                              Action.SLEEP: 0, Action.UNLOAD: 0})


def steps(plan) -> list[tuple[str, str]]:
    return [(s.name, s.action) for s in plan.steps]


def test_the_least_recently_used_goes_first_and_only_as_far_as_needed():
    models = [dense("new", 100, used=3.0), moe("old", 100, experts=40, used=1.0),
              dense("mid", 100, used=2.0)]
    plan = plan_eviction(models, 30)  # the old model's experts suffice
    assert plan.is_enough and steps(plan) == [("old", "release_experts")]
    plan = plan_eviction(models, 150)  # the old one sleeps, the next one too
    assert plan.is_enough and steps(plan) == [("old", "sleep"), ("mid", "sleep")]
    assert [s.freed_bytes for s in plan.steps] == [100, 100]


def test_busy_models_are_never_chosen_and_a_short_plan_says_what_is_missing():
    models = [dense("busy", 500, used=0.0, is_busy=True), dense("idle", 100, used=5.0)]
    plan = plan_eviction(models, 300)
    assert not plan.is_enough and steps(plan) == [("idle", "sleep")]
    assert plan.shortfall_bytes == 200
    assert plan_eviction(models, 0) == plan_eviction([], -5)
    assert plan_eviction([], -5).is_enough


def test_on_a_gpu_a_sleeping_model_still_holds_its_context_so_unload_frees_more():
    gpu = Candidate("m", 2000, 0.0, after={Action.SLEEP: 500, Action.UNLOAD: 0})
    assert steps(plan_eviction([gpu], 1000)) == [("m", "sleep")]
    assert steps(plan_eviction([gpu], 1800)) == [("m", "unload")]


def test_budget_and_free_vram_arithmetic():
    # 300 held by others + 200 for the target in a 400 budget: 100 must go.
    assert budget_need_bytes(400, 200, 0, [100, 200]) == 100
    assert budget_need_bytes(400, 200, 200, [100, 100]) == 0  # it holds its bytes already
    assert budget_need_bytes(1000, 200, 0, [100]) < 0
    # Waking a model that still holds 50 of its 200 needs 150 more, plus the reserve.
    assert free_need_bytes(100, 200, 50, 20) == 70
    assert free_need_bytes(500, 200, 50, 20) < 0


def test_what_a_model_holds_at_each_level():
    size = MemberSize(1000, expert_bytes=300)
    assert size.held_bytes(None, is_gpu=True) == 0
    assert size.held_bytes(State.LOADED, is_gpu=False) == 1000
    assert size.held_bytes(State.LOADING, is_gpu=False) == 1000  # room was made for it
    assert size.held_bytes(State.EXPERTS_RELEASED, is_gpu=True) == 700
    assert size.held_bytes(State.SLEEPING, is_gpu=False) == 0
    assert MemberSize(SLEEPING_GPU_BYTES * 2).held_bytes(State.SLEEPING, is_gpu=True) == \
        SLEEPING_GPU_BYTES
    assert size.held_bytes(State.UNLOADED, is_gpu=True) == 0


# ---- names --------------------------------------------------------------------------------


def entry(path: Path, name: str) -> ModelEntry:
    return ModelEntry(name, path, "gguf", 1, "llama", "Q4_0", 1, 1)


def test_configured_models_are_checked():
    assert configured_models(None) == []
    found = configured_models({"coder": {"path": "~/m.gguf", "aliases": ["gpt-4o-mini"]},
                               "smol": {"aliases": "s"}})
    assert found[0].path == Path("~/m.gguf").expanduser() and found[1].aliases == ("s",)
    for bad, words in (({"x": 1}, "must be a table"), ({"x": {"file": "a"}}, "'file'"),
                       ({"x": {"aliases": [1]}}, "aliases"), ([], "[models]")):
        with pytest.raises(ModelsConfigError, match=words):
            configured_models(bad)


def test_the_config_files_models_tables_are_not_settings(tmp_path):
    from strata.engine.service.settings import load_settings
    from strata.host.root import Host

    path = tmp_path / "config.toml"
    path.write_text('models-dir = "/srv/models"\nmodel-fallback = "default"\n'
                    '[models.coder]\npath = "/srv/c.gguf"\naliases = ["gpt-4o-mini"]\n')
    settings = load_settings(path, {})
    assert settings.models_dir == "/srv/models" and settings.model_fallback == "default"
    host = Host.from_config(path, {})
    assert configured_models(host.config["models"])[0].aliases == ("gpt-4o-mini",)


def write_model_dir(path: Path) -> Path:
    """An HF-style directory: tokenizer files, a config and an empty safetensors file."""
    write_tiny_model_dir(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                  "num_hidden_layers": 1}))
    (path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return path


def test_names_match_by_tag_file_name_alias_and_case(tmp_path):
    models_dir = tmp_path / "models"
    for name in ("a", "Big-Model"):
        write_model_dir(models_dir / name)
    outside = write_model_dir(tmp_path / "elsewhere" / "coder")
    index = build_index(models_dir, configured_models({
        "coder": {"path": str(outside), "aliases": ["gpt-4o-mini"]},
        "Big-Model": {"aliases": ["big"]}, "missing": {"path": str(tmp_path / "no")}}),
        models_dir / "a", "served-as")
    assert index.names[0] == "served-as" and index.default is index.specs[0]
    assert {"Big-Model", "coder"} <= set(index.names) and "missing" not in index.names
    for name, expected in (("served-as", "served-as"), ("a", "served-as"), (None, "served-as"),
                           ("default", "served-as"), ("Big-Model:latest", "Big-Model"),
                           ("big", "Big-Model"), ("BIG-model", "Big-Model"),
                           ("gpt-4o-mini", "coder"), ("coder:latest", "coder")):
        found = index.find(name)
        assert found is not None and found.name == expected, name
    assert index.find("nope") is None


def test_the_default_models_file_served_from_elsewhere_is_listed_once(tmp_path, monkeypatch,
                                                                      smollm2_gguf):
    """`serve --model /else/SmolLM2...gguf` with an empty cache: the embedded default's offer
    is that same model, not a second one (llama.cpp's tests expect one entry)."""
    served = tmp_path / "elsewhere" / smollm2_gguf.name
    served.parent.mkdir()
    served.symlink_to(smollm2_gguf)
    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "home"))  # its cache holds nothing
    models_dir = tmp_path / "home" / "models"
    models_dir.mkdir(parents=True)
    assert build_index(models_dir, [], served, "tinyllama-2").names == ["tinyllama-2"]
    other = tmp_path / "other" / "mine.gguf"
    other.parent.mkdir()
    other.symlink_to(smollm2_gguf)  # another file: the default stays on offer beside it
    assert len(build_index(models_dir, [], other, "mine").names) == 2


def test_a_gguf_file_answers_with_and_without_its_suffix(tmp_path):
    from strata.engine.service.model_pool_names import ModelIndex

    path = tmp_path / "m.Q4_0.gguf"
    index = ModelIndex([ModelSpec("m.Q4_0", entry(path, "m.Q4_0"), is_default=True)])
    assert index.find("m.Q4_0.gguf").name == index.find("m.Q4_0").name == "m.Q4_0"


# ---- a pool of fake engines ---------------------------------------------------------------

SIZES = {"a": MemberSize(64 * MIB), "b": MemberSize(96 * MIB, 32 * MIB),
         "c": MemberSize(64 * MIB), "huge": MemberSize(1024 * MIB)}


def fake_service(settings: ServeSettings, *, keep_standby: bool = True,
                 vram_reader=lambda: None) -> Service:
    """A Service over the fake engine sized as SIZES says (b is a MoE model)."""
    size = SIZES[Path(settings.model).name]
    config = FakeEngineConfig(model_path=settings.model,
                              weights_bytes=size.full_bytes - size.expert_bytes,
                              expert_bytes=size.expert_bytes)
    return Service(settings, engine_factory=FAKE_ENGINE_FACTORY, engine_config=config,
                   supervisor_options={"backoff_base_s": 0.2, "backoff_max_s": 0.4},
                   vram_reader=vram_reader, keep_standby=False)


@pytest.fixture
async def pool(tmp_path):
    models_dir = tmp_path / "models"
    for name in SIZES:
        write_model_dir(models_dir / name)
    settings = ServeSettings(model=str(models_dir / "a"), device="cpu",
                             models_dir=str(models_dir), vram_budget_bytes=200 * MIB,
                             snapshot_dir=str(tmp_path / "snapshots"))
    pool = ModelPool(settings, service_factory=fake_service,
                     estimate=lambda path, **_: SIZES.get(Path(path).name, MemberSize(0)))
    events = []
    pool.level_listeners.append(events.append)
    await pool.start()
    pool.events = events
    yield pool
    await pool.stop()


def states(pool: ModelPool) -> dict[str, str]:
    return {row["name"]: row["state"] for row in pool.models() if row["name"] in SIZES}


async def ask(pool: ModelPool, name: str | None) -> None:
    await answer(await pool.resolve(name), [5, 6, 7], max_tokens=2)


async def test_under_the_budget_the_least_recently_used_gives_back_the_least(pool):
    assert states(pool) == {"a": "loaded", "b": "available", "c": "available",
                            "huge": "available"}
    await ask(pool, "b")  # 64 + 96 fit in 200
    await ask(pool, "a")  # b is now the least recently used
    assert states(pool)["b"] == "loaded" and states(pool)["a"] == "loaded"
    await ask(pool, "c")  # 64 + 96 + 64 > 200: b's experts (32) free enough
    assert states(pool) == {"a": "loaded", "b": "experts_released", "c": "loaded",
                            "huge": "available"}
    assert [(e.action, e.cause) for e in pool.events if e.model == "b"] == [
        ("load", None), ("release_experts", "to make room for c")]
    await ask(pool, "b")  # b's refill needs 32 more: a (oldest now) sleeps
    assert states(pool) == {"a": "sleeping", "b": "loaded", "c": "loaded", "huge": "available"}
    assert sum(row["vram_bytes"] for row in pool.models()) <= pool.budget_bytes
    with pytest.raises(ServiceError) as refused:
        await ask(pool, "huge")
    assert refused.value.code == "insufficient_vram" and "whole VRAM budget" in \
        refused.value.message
    assert states(pool)["c"] == "loaded"  # nothing was taken down for a model that cannot fit


async def test_a_model_serving_a_request_is_not_taken_down(pool):
    await ask(pool, "b")  # a is the least recently used now
    member_a = pool.member("a")
    member_a.num_requests += 1  # as while a generation of a runs
    try:
        await ask(pool, "c")  # 64 + 96 + 64 > 200: a would go first, but it serves
    finally:
        member_a.num_requests -= 1
    assert states(pool)["a"] == "loaded" and states(pool)["b"] == "experts_released"


async def test_rules_and_buttons_act_on_every_resident_model_and_bring_them_back(pool):
    await ask(pool, "c")
    result = await pool.control("sleep")
    assert set(result["results"]) == {"a", "c"} and result["model"] == "a"
    assert states(pool)["a"] == states(pool)["c"] == "sleeping"
    result = await pool.control("wake")
    assert set(result["results"]) == {"a", "c"}
    assert State(states(pool)["a"]).is_up and State(states(pool)["c"]).is_up
    result = await pool.control("unload", model="c")
    assert result["model"] == "c" and states(pool)["c"] == "unloaded"
    with pytest.raises(ModelNotFound):
        await pool.control("load", model="nope")
    status = pool.status()
    assert status["default_model"] == "a" and status["model"] == "a"
    assert shape_problems(status, PoolStatus) == []  # ServiceStatus's keys and the pool's


async def test_two_models_asked_at_once_take_turns_at_making_room(pool):
    await asyncio.gather(ask(pool, "b"), ask(pool, "c"), ask(pool, "b"))
    found = states(pool)
    assert found["a"] == "sleeping" and State(found["b"]).is_up and State(found["c"]).is_up
    assert sum(row["vram_bytes"] for row in pool.models()) <= pool.budget_bytes
