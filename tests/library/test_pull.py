"""`strata pull`, `strata list` and `strata rm` against a local hub over real HTTP."""

from __future__ import annotations

import asyncio
import threading

import pytest

from strata.cli import main
from strata.library.catalog import find, scan
from strata.library.pull import PullCancelled, PullError, PullProgress, pull


async def test_pull_one_quantization_into_the_library(hub, tmp_path, gguf_bytes):
    path = await asyncio.to_thread(pull, "acme/tiny-GGUF:Q4_K_M", tmp_path, progress=False)
    assert path == tmp_path / "acme/tiny-GGUF/tiny-Q4_K_M.gguf"
    assert path.read_bytes() == gguf_bytes + b"4"
    assert not (tmp_path / "acme/tiny-GGUF/tiny-Q8_0.gguf").exists()
    entry = find("tiny-Q4_K_M", tmp_path)
    assert entry.format == "gguf" and entry.size_bytes == len(gguf_bytes) + 1
    assert any(method == "GET" and "resolve" in path for method, path in hub.requests)


async def test_pull_a_hugging_face_directory(hub, tmp_path):
    path = await asyncio.to_thread(pull, "acme/tiny-hf", tmp_path, progress=False)
    assert sorted(p.name for p in path.iterdir() if p.is_file()) == [
        "config.json", "model.safetensors", "tokenizer.json"]
    assert "acme/tiny-hf" in [e.name for e in scan(tmp_path)]


@pytest.mark.parametrize(("spec", "words"), [
    ("acme/tiny-GGUF", "several GGUF files"),
    ("acme/tiny-GGUF:Q5_K_M", "matches none"),
    ("acme/missing", "was not found"),
    ("not-a-repo", "OWNER/REPO"),
])
async def test_refusals_name_the_choices(hub, tmp_path, spec, words):
    with pytest.raises(PullError, match=words):
        await asyncio.to_thread(pull, spec, tmp_path, progress=False)
    assert not list(tmp_path.rglob("*.gguf"))


async def test_a_corrupted_download_is_deleted(hub, tmp_path):
    hub.corrupt.add("tiny-Q8_0.gguf")
    with pytest.raises(PullError, match="SHA-256"):
        await asyncio.to_thread(pull, "acme/tiny-GGUF:tiny-Q8_0.gguf", tmp_path, progress=False)
    assert not list(tmp_path.rglob("*.gguf"))


async def test_cli_pull_list_rm(hub, tmp_path, capsys):
    code = await asyncio.to_thread(main, ["pull", "acme/tiny-GGUF:Q8_0", "--models-dir",
                                          str(tmp_path)])
    assert code == 0
    assert await asyncio.to_thread(main, ["list", "--models-dir", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "tiny-Q8_0" in listing and "SmolLM2-135M-Instruct.Q4_1" in listing
    assert await asyncio.to_thread(main, ["rm", "tiny-Q8_0", "--models-dir", str(tmp_path)]) == 0
    assert not (tmp_path / "acme").exists()  # the emptied folders go too
    assert await asyncio.to_thread(main, ["rm", "tiny-Q8_0", "--models-dir", str(tmp_path)]) == 2
    assert "no model 'tiny-Q8_0'" in capsys.readouterr().err


async def test_progress_reaches_the_file_size_then_verifies(hub, tmp_path, gguf_bytes):
    hub.chunk_bytes, hub.chunk_delay_s = 1024, 0.005  # pieces that arrive one by one
    reports: list[PullProgress] = []
    await asyncio.to_thread(pull, "acme/tiny-GGUF:Q8_0", tmp_path, progress=False,
                            on_progress=reports.append)
    downloading = [r for r in reports if r.phase == "downloading"]
    assert downloading[0].completed_bytes == 0
    assert downloading[-1].completed_bytes == downloading[-1].total_bytes == len(gguf_bytes)
    completed = [r.completed_bytes for r in downloading]
    assert completed == sorted(completed) and len(set(completed)) > 2  # it moved, in steps
    assert reports[-1].phase == "verifying" and reports[-1].file.name == "tiny-Q8_0.gguf"
    assert {(r.file_index, r.num_files) for r in reports} == {(0, 1)}


async def test_a_directory_reports_each_file(hub, tmp_path):
    reports: list[PullProgress] = []
    await asyncio.to_thread(pull, "acme/tiny-hf", tmp_path, progress=False,
                            on_progress=reports.append)
    assert sorted({r.file.name for r in reports}) == [
        "config.json", "model.safetensors", "tokenizer.json"]
    assert {r.num_files for r in reports} == {3}


async def test_cancel_stops_mid_file_and_a_later_pull_completes(hub, tmp_path, gguf_bytes):
    hub.chunk_bytes, hub.chunk_delay_s = 1024, 0.01
    cancel = threading.Event()

    def stop_halfway(report: PullProgress) -> None:
        if report.completed_bytes >= 2048:
            cancel.set()

    with pytest.raises(PullCancelled):
        await asyncio.to_thread(pull, "acme/tiny-GGUF:Q8_0", tmp_path, progress=False,
                                on_progress=stop_halfway, cancel=cancel)
    assert not (tmp_path / "acme/tiny-GGUF/tiny-Q8_0.gguf").exists()
    assert (tmp_path / "acme/tiny-GGUF/.strata-partial/tiny-Q8_0.gguf.part").is_file()
    assert "tiny-Q8_0" not in [e.name for e in scan(tmp_path)]  # a part is not a model
    path = await asyncio.to_thread(pull, "acme/tiny-GGUF:Q8_0", tmp_path, progress=False)
    assert path.read_bytes() == gguf_bytes


async def test_a_preferred_quantization_picks_among_several(hub, tmp_path, gguf_bytes):
    path = await asyncio.to_thread(pull, "acme/tiny-GGUF", tmp_path, progress=False,
                                   preferred="Q4_K_M")
    assert path.name == "tiny-Q4_K_M.gguf"


@pytest.mark.parametrize("source", ["environment", "config file"])
async def test_cli_uses_the_servers_library_without_the_flag(hub, tmp_path, monkeypatch,
                                                              capsys, source):
    """pull, list and rm work on the directory `strata serve` serves from."""
    library = tmp_path / "library"
    monkeypatch.setenv("STRATA_CONFIG", str(tmp_path / "config.toml"))
    if source == "environment":
        monkeypatch.setenv("STRATA_MODELS_DIR", str(library))
    else:
        monkeypatch.delenv("STRATA_MODELS_DIR", raising=False)
        (tmp_path / "config.toml").write_text(f'models-dir = "{library.as_posix()}"\n')
    assert await asyncio.to_thread(main, ["pull", "acme/tiny-GGUF:Q8_0"]) == 0
    assert (library / "acme/tiny-GGUF/tiny-Q8_0.gguf").is_file()
    assert await asyncio.to_thread(main, ["list"]) == 0
    assert "tiny-Q8_0" in capsys.readouterr().out
    assert await asyncio.to_thread(main, ["rm", "tiny-Q8_0"]) == 0
    assert not (library / "acme").exists()
