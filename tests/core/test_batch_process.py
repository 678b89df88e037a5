"""The real engine process (core/process.py, the real Engine on a tiny llama, CPU) serving
several Generates at once: they interleave, each gets its own tokens and a Done with its
slot, GetStatus shows the batch, Cancel ends one, and a level command waits for the drain."""

from __future__ import annotations

import multiprocessing

import pytest

from strata.engine import protocol as p
from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.core.process import DEFAULT_ENGINE_FACTORY, engine_main
from tests.snapshots.helpers import save_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
CTX = multiprocessing.get_context("spawn")
SPEC = p.SamplingSpec(max_tokens=40)


def prompt(i: int) -> tuple[int, ...]:
    return tuple((11 * i + j) % 300 + 5 for j in range(20 + 5 * i))


def test_concurrent_generates_share_one_batch(tmp_path) -> None:
    model_dir = save_tiny_llama(tmp_path / "model", seed=0)
    config = EngineConfig(model_path=str(model_dir), device="cpu", context_tokens=256,
                          snapshot_dir=str(tmp_path / "snapshots"), num_slots=4, parallel=3)
    reference = Engine(config)
    reference.load()
    expected = {f"g{i}": [t for ids in reference.generate(prompt(i), SPEC, slot=0) for t in ids]
                for i in range(4)}
    reference.close()

    conn, child = CTX.Pipe()
    process = CTX.Process(target=engine_main, args=(child, DEFAULT_ENGINE_FACTORY, config),
                          daemon=True)
    process.start()
    child.close()
    tokens: dict[str, list[int]] = {f"g{i}": [] for i in range(5)}
    done: dict[str, p.Done] = {}
    order: list[str] = []  # request ids of Tokens events as they came
    replies: dict[int, p.Event] = {}

    def pump(until) -> None:
        while not until():
            assert conn.poll(60), "the engine process went quiet"
            event = conn.recv()
            if isinstance(event, p.Tokens):
                tokens[event.request_id] += event.token_ids
                order.append(event.request_id)
            elif isinstance(event, p.Done):
                done[event.request_id] = event
            else:
                assert not isinstance(event, p.Error), f"engine error: {event}"
                replies[event.command_id] = event

    try:
        assert isinstance(conn.recv(), p.Ready)
        conn.send(p.Envelope(1, p.Load(str(model_dir), 256, "cpu")))
        pump(lambda: 1 in replies)
        for i in range(5):  # parallel 3: g3 and g4 wait
            conn.send(p.Envelope(10 + i, p.Generate(f"g{i}", prompt(i), SPEC, slot=None)))
        conn.send(p.Envelope(20, p.GetStatus()))
        conn.send(p.Envelope(21, p.Cancel("g4")))  # still waiting: Done without a slot
        conn.send(p.Envelope(22, p.SaveSlot(0, "after.bin")))  # waits for the drain
        pump(lambda: 20 in replies and "g4" in done)
        batch = replies[20].engine.batch
        assert batch.parallel == 3 and batch.running + batch.waiting == 5
        assert replies[20].engine.num_slots == 4
        assert done["g4"].slot is None and done["g4"].usage.finish_reason == "cancelled"
        pump(lambda: 22 in replies)
        assert all(f"g{i}" in done for i in range(4))  # SaveSlot answered after the drain
    finally:
        conn.send(p.Envelope(99, p.Unload()))
        process.join(30)
        if process.exitcode is None:
            process.kill()
    for i in range(4):
        assert tokens[f"g{i}"] == expected[f"g{i}"]
        usage = done[f"g{i}"].usage
        assert (usage.completion_tokens, usage.finish_reason) == (40, "length")
    assert len({done[f"g{i}"].slot for i in range(3)}) == 3  # three at once, three slots
    # The streams interleaved: g1's tokens arrived before g0 had all of its own.
    assert order.index("g1") < len(order) - order[::-1].index("g0") - 1
    assert isinstance(replies[22], p.Reply)
