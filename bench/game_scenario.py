"""A game starts while Strata serves a MoE model: does the rule give the VRAM back in time, and
does the model come back, with the conversation's cache, when the game exits?

    python bench/game_scenario.py --out game.json [--layers 8] [--prompt-tokens 16384]
                                  [--actions shrink_experts release_experts offload_session sleep unload]
                                  [--trigger process|gpu_process] [--cpu-dry-run]

Serves a random-weights Qwen3-30B-A3B with --layers layers through the real Service and engine
process, with a process rule (rules_engine.py, the process watcher) whose pattern matches
bench/game_process.py. For each action: a conversation's first turn (the cold prompt), then a "game"
process starts and allocates what fits only once the action has released its memory (free VRAM - the
game's own CUDA context + half of what the action frees), holds it while a request arrives, and
exits. With shrink_experts the rule keeps what the game maps free and the model must keep answering
while the game holds it. Recorded: time from the game's start to the engine's VRAM released (NVML,
per process), whether the game's first allocation succeeded, the answer to the request meanwhile,
time from the game's exit to the model back, and the follow-up turn's cached tokens and time to
first token against the cold prompt. Prints a table, writes JSON.
Targets (issue 18): release <= 300 ms, first allocation ok, back <= 2 s (unload: <= its load);
asleep, the engine holds at most its CUDA context + 64 MiB (compare engine_held_during_mib of
the sleep row with game_context_bytes, a bare driver context).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata

from strata.engine.core.engine_config import EngineConfig
from strata.engine.core.memory.vram import _device_handle, _load_nvml, read_free_vram_bytes
from strata.engine.protocol import SamplingSpec
from strata.engine.service.facade import GenerationRequest, ServiceError
from strata.engine.service.rules import Rule
from strata.engine.service.rules_engine import RulesEngine
from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings

GAME = Path(__file__).resolve().parent / "game_process.py"
ACTIONS = ("shrink_experts", "release_experts", "offload_session", "sleep", "unload")
MIB = 1 << 20
# What each action frees, by arena (the engine's status before the game starts).
FREES = {"shrink_experts": ("experts",), "release_experts": ("experts",), "offload_session": ("kv",),
         "sleep": ("weights", "experts", "kv"), "unload": ("weights", "experts", "kv")}


def model_config(layers: int, is_tiny: bool = False) -> dict:
    from strata.engine.core.random_weights import PRESETS

    if is_tiny:  # --cpu-dry-run: the same code paths on a model a laptop CPU runs
        return {**PRESETS["qwen3-30b-a3b"], "num_hidden_layers": layers, "vocab_size": 4096,
                "hidden_size": 128, "moe_intermediate_size": 64, "num_experts": 8,
                "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 32}
    return {**PRESETS["qwen3-30b-a3b"], "num_hidden_layers": layers}


class EngineVram:
    """Samples the engine process's VRAM (NVML, per process) every 2 ms in a thread."""

    def __init__(self):
        self.nvml = _load_nvml()
        self.handle = _device_handle(self.nvml, 0) if self.nvml else None
        self.samples: list[tuple[float, dict[int, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def used_by_pid(self) -> dict[int, int]:
        if self.nvml is None:  # --cpu-dry-run: no GPU to read
            return {}
        entries = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        return {e.pid: int(e.usedGpuMemory or 0) for e in entries}

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((time.time(), self.used_by_pid()))
            time.sleep(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def released_at(self, pid: int, after: float, below_bytes: int) -> float | None:
        """First sample time after `after` where pid holds less than below_bytes (or is gone)."""
        return next((t for t, used in self.samples if t >= after
                     and used.get(pid, 0) < below_bytes), None)


async def turn(service: Service, prompt: list[int], slot: int, max_tokens: int = 8) -> dict:
    """One generation: first-token time, tokens, usage, or the refusal."""
    started = time.perf_counter()
    ids, usage, first_s = [], None, None
    try:
        async for event in service.generate(GenerationRequest(
                tuple(prompt), SamplingSpec(max_tokens=max_tokens), slot)):
            if hasattr(event, "token_ids") and first_s is None:
                first_s = time.perf_counter() - started
            ids += list(getattr(event, "token_ids", ()))
            usage = getattr(event, "usage", usage)
            if hasattr(event, "code"):
                return {"answer": f"error {event.code}", "message": event.message}
    except ServiceError as exc:
        return {"answer": f"{exc.status} {exc.code}", "retry_after_s": exc.retry_after_s,
                "message": exc.message, "after_s": round(time.perf_counter() - started, 3)}
    return {"answer": "tokens", "ids": ids, "ttft_s": first_s,
            "cached_tokens": usage.cached_tokens if usage else None,
            "prompt_tokens": len(prompt)}


async def wait_for(predicate, timeout_s: float, step_s: float = 0.005) -> float | None:
    """Seconds until predicate() holds, None past timeout_s."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if predicate():
            return time.perf_counter() - started
        await asyncio.sleep(step_s)
    return None


async def game_context_bytes(work: Path) -> int:
    """What a game's CUDA context costs: free VRAM before and while a 0-byte game holds."""
    out = work / "calibrate.json"
    free_before = read_free_vram_bytes(0)
    if free_before is None:  # --cpu-dry-run
        return 0
    game = subprocess.Popen([sys.executable, str(GAME), "--bytes", "0", "--hold-s", "1.5",  # noqa: ASYNC220
                             "--out", str(out)])
    await wait_for(out.exists, 30.0)
    await asyncio.sleep(0.2)
    free_during = read_free_vram_bytes(0) or free_before
    await asyncio.to_thread(game.wait)
    return max(0, free_before - free_during)


async def one_action(service: Service, action: str, args, work: Path, context_bytes: int,
                     seed: int) -> dict:
    rng = random.Random(seed)
    vocab = service.text.vocab_size
    prompt = [rng.randrange(100, vocab - 100) for _ in range(args.prompt_tokens)]
    await service.control("load")
    first = await turn(service, prompt, slot=0)
    status = service.status()
    engine_pid = status["engine_pid"]
    frees = sum(status["vram"].get(a, {}).get("resident_bytes", 0) for a in FREES[action])
    free_before = read_free_vram_bytes(0) or 0
    # The game needs half of what the action frees; with shrink_experts a quarter: shrinking
    # keeps at least one layer's experts (in a 4-layer model that is a quarter of them) and
    # frees whole arena chunks, so half plus the game's context and the margin did not fit.
    needs_freed = frees // (4 if action == "shrink_experts" else 2)
    game_bytes = max(MIB, free_before - context_bytes + needs_freed)
    events = []
    # shrink_experts keeps free what the game maps (its context and allocation) + a margin.
    keep_free_mib = (game_bytes + context_bytes) // MIB + 256 if action == "shrink_experts" \
        else 0
    patterns = ("*/game_process.py",) if args.trigger == "process" else ()
    supervisor = service.supervisor

    def own_pids() -> set[int]:  # this process, its engine and standby (not the game)
        return {os.getpid(), supervisor.pid or -1, supervisor.standby_pid or -1}

    rules = RulesEngine(service, [Rule(action, args.trigger, action, "restore", patterns,
                                       keep_free_mib=keep_free_mib)],
                        on_event=lambda e: events.append((time.time(), e)),
                        own_pids=own_pids)
    rules_task = asyncio.create_task(rules.run(0.5))
    await asyncio.sleep(0.5)  # the watcher's first tick has read every running process
    out = work / f"game-{action}.json"
    row = {"action": action, "frees_bytes": frees, "game_bytes": game_bytes}
    with EngineVram() as vram:
        engine_used = vram.used_by_pid().get(engine_pid, 0)
        started = time.time()
        game = subprocess.Popen([sys.executable, str(GAME), "--bytes", str(game_bytes),  # noqa: ASYNC220
                                 "--hold-s", str(args.hold_s), "--out", str(out),
                                 "--api", args.game_api])
        await wait_for(out.exists, 30.0)
        await asyncio.sleep(0.3)
        # What the engine still holds while the game runs (asleep: its CUDA context, ideally).
        held_during = vram.used_by_pid().get(engine_pid, 0)
        during = await turn(service, [11, 12, 13, 14], slot=2, max_tokens=4)
        during.pop("ids", None)
        await asyncio.to_thread(game.wait)
        exited = time.time()
        released = vram.released_at(engine_pid, started, engine_used - needs_freed) \
            if vram.nvml else None
    # The way back, as (seconds after the game exited, state, busy) at each change: where
    # the time between the exit and a whole model goes (episode end, restore, load, wake).
    timeline: list[tuple[float, str, bool]] = []

    def is_whole() -> bool:
        status = service.status()
        mark = (status["state"], bool(status["is_busy"]))
        if not timeline or timeline[-1][1:] != mark:
            timeline.append((round(time.time() - exited, 3), *mark))
        experts = status.get("experts") or {}
        return (status["state"] in ("loaded", "session_offloaded") and not status["is_busy"]
                and experts.get("num_slots") == experts.get("max_slots", experts.get("num_slots")))

    is_back = await wait_for(is_whole, 120.0, 0.01)
    back_s = None if is_back is None else time.time() - exited
    follow = prompt + first.get("ids", []) + [rng.randrange(100, vocab - 100)
                                              for _ in range(32)]
    second = await turn(service, follow, slot=0)
    rules_task.cancel()
    await asyncio.gather(rules_task, return_exceptions=True)
    game_result = json.loads(out.read_text()) if out.exists() else {}
    row.update(
        release_s=None if released is None else round(released - started, 3),
        game_first_alloc_s=round(game_result.get("first_at", started) - started, 3),
        game_first_ok=game_result.get("first_ok"), game_num_tries=game_result.get("num_tries"),
        game_ok=game_result.get("ok"), request_during=during,
        engine_held_during_mib=held_during // MIB, engine_held_before_mib=engine_used // MIB,
        back_s=None if back_s is None else round(back_s, 3), game_exit_code=game.returncode,
        cold_ttft_s=first.get("ttft_s"), cold_prompt_tokens=len(prompt),
        followup_ttft_s=second.get("ttft_s"), followup_cached_tokens=second.get("cached_tokens"),
        followup_prompt_tokens=len(follow), followup_answer=second.get("answer"),
        rule_events=[e.sentence for _, e in events],
        rule_event_after_exit_s=[round(t - exited, 3) for t, _ in events], back_timeline=timeline,
        load_time_s=(service.status()["engine"]["model_info"] or {}).get("load_time_s"),
    )
    return row


async def decode_at_fractions(service: Service, fractions: list[float], total_experts: int,
                              vocab: int) -> list[dict]:
    """Decode tok/s with that fraction of the experts resident (shrink_experts' slots)."""
    from strata.engine import protocol as p

    rows = []
    rng = random.Random(7)
    for fraction in fractions:
        reply = await service.supervisor.command(p.ResizeExperts(max(1, int(fraction * total_experts))))
        await service.lifecycle._refresh()
        prompt = [rng.randrange(100, vocab - 100) for _ in range(64)]
        started = time.perf_counter()
        result = await turn(service, prompt, slot=3, max_tokens=129)
        ended = time.perf_counter()
        num_slots = int(reply.result["num_slots"])
        decode_s = (ended - started) - (result.get("ttft_s") or 0.0)
        rows.append({"fraction_asked": fraction, "num_slots": num_slots,
                     "fraction_resident": round(num_slots / total_experts, 3),
                     "decode_tok_s": round(128 / decode_s, 1) if decode_s > 0 else None,
                     "answer": result.get("answer")})
        print(json.dumps(rows[-1]), flush=True)
    await service.control("refill_experts")
    return rows


async def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="strata-game-"))
    config_path = work / "config.json"
    config = model_config(args.layers, args.cpu_dry_run)
    config_path.write_text(json.dumps(config))
    expert_cache = "auto"
    if "shrink_experts" in args.actions:  # shrinking needs a partial cache (slots mode)
        expert_cache = str(int(0.9 * args.layers * config["num_experts"]))
    engine_config = EngineConfig(model_path=f"random-qwen3-moe-{args.layers}l",
                                 device="cpu" if args.cpu_dry_run else "cuda",
                                 context_tokens=args.prompt_tokens * 2,
                                 snapshot_dir=str(work / "snapshots"),
                                 random_weights=str(config_path), expert_cache=expert_cache)
    service = Service(ServeSettings(vram_wait_s=args.vram_wait_s, context_tokens=engine_config
                                    .context_tokens), engine_config=engine_config,
                      text_assets=SimpleNamespace(vocab_size=config["vocab_size"]))
    started = time.perf_counter()
    await service.start()
    load_s = time.perf_counter() - started
    rows = []
    try:
        context_bytes = await game_context_bytes(work)
        for i, action in enumerate(args.actions):
            print(f"-- {action}", flush=True)
            rows.append(await one_action(service, action, args, work, context_bytes, seed=i))
            print(json.dumps(rows[-1], default=str), flush=True)
        decode = []
        fractions = getattr(args, "decode_fractions", None)
        if expert_cache != "auto" and fractions:
            await service.control("load")
            decode = await decode_at_fractions(service, fractions,
                                               args.layers * config["num_experts"],
                                               config["vocab_size"])
    finally:
        await service.stop()
    return {"model": f"qwen3-30b-a3b with {args.layers} layers, random weights",
            "first_load_s": round(load_s, 3), "game_context_bytes": context_bytes,
            "prompt_tokens": args.prompt_tokens, "game_api": args.game_api,
            "expert_cache": expert_cache, "trigger": args.trigger, "rows": rows,
            "decode_by_resident_fraction": decode}


def table(report: dict) -> str:
    head = (f"{'action':16} {'release ms':>10} {'1st alloc':>9} {'during':>22} {'back s':>7} "
            f"{'cached':>7} {'cold ttft':>9} {'follow ttft':>11}")
    lines = [head]
    for r in report["rows"]:
        release = "n/a" if r["release_s"] is None else f"{r['release_s'] * 1000:.0f}"
        lines.append(
            f"{r['action']:16} {release:>10} {r['game_first_ok']!s:>9} "
            f"{r['request_during']['answer'][:22]:>22} {r['back_s']!s:>7} "
            f"{r['followup_cached_tokens']!s:>7} {r['cold_ttft_s'] or 0:9.3f} "
            f"{r['followup_ttft_s'] or 0:11.3f}")
    # unload's target: back within the time the model took to come up at the start (a fresh
    # engine process to ready), which is what a user waits for without Strata's standby.
    lines.append(f"first load (service start to ready): {report['first_load_s']} s; restore "
                 f"loads: " + ", ".join(f"{r['action']} {r['load_time_s']} s"
                                        for r in report["rows"] if r["action"] == "unload"))
    for d in report.get("decode_by_resident_fraction") or []:
        lines.append(f"decode with {d['fraction_resident']:.0%} of the experts resident "
                     f"({d['num_slots']} slots): {d['decode_tok_s']} tok/s")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON report path")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--hold-s", type=float, default=2.0)
    parser.add_argument("--vram-wait-s", type=float, default=0.5)
    parser.add_argument("--game-api", choices=("cuda", "torch", "none"), default="cuda")
    parser.add_argument("--actions", nargs="+", choices=ACTIONS, default=list(ACTIONS),
                        help="shrink_experts runs every action over a partial expert cache "
                             "(90%% of the experts: --expert-cache N), which shrinking needs")
    parser.add_argument("--decode-fractions", type=float, nargs="*", default=[1.0, 0.5, 0.25, 0.1],
                        help="with shrink_experts: decode tok/s at these fractions of the "
                             "experts resident (never below one layer's experts)")
    parser.add_argument("--trigger", choices=("process", "gpu_process"), default="process",
                        help="the rule's trigger: the game's process starting (matched by its "
                             "script), or any other process starting to use the GPU (NVML)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="a tiny model on the CPU and a game that allocates nothing: checks "
                             "the scenario's code paths where there is no GPU")
    args = parser.parse_args()
    if args.cpu_dry_run:
        args.game_api = "none"
    report = asyncio.run(run(args))
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
