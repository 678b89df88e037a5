"""`strata pull REPO[:FILE]`: fetch a GGUF file or a Hugging Face model from the hub.

huggingface_hub does the transfer (it is what the hub's own tools use: retries that resume a
dropped connection, HF_ENDPOINT and HF_TOKEN honoured, progress bars), so Strata only chooses
the files and checks each file's SHA-256 against the hub's record of it. Callers without a
console (the Ollama API's /api/pull, the tray) follow a pull through `on_progress` and stop it
through `cancel`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from strata.errors import StrataError
from strata.paths import model_cache_dir

# What a Hugging Face directory needs to load; weights, tokenizer and templates.
HF_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "*.safetensors",
               "*.safetensors.index.json")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
_HASH_CHUNK_BYTES = 8 << 20


class PullError(StrataError, RuntimeError):
    """The model could not be fetched; the message says why and what to pick instead."""


class RepoNotFoundError(PullError):
    """The hub has no such repository (or it is private and no token was given)."""


class DownloadError(PullError):
    """The hub listed the model but a file did not arrive (network, disk, hub error)."""


class PullCancelled(PullError):
    """The caller stopped the pull (its `cancel` event was set); the partial file is gone."""


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size_bytes: int | None
    sha256: str | None  # the hub records it for files kept in LFS


@dataclass(frozen=True)
class PullProgress:
    """Where a pull stands: one file downloading (completed of total bytes), or verified."""

    file: RemoteFile
    phase: str  # downloading | verifying
    completed_bytes: int
    total_bytes: int | None
    file_index: int  # 0-based, of num_files
    num_files: int


ProgressCallback = Callable[[PullProgress], None]


def parse_spec(spec: str) -> tuple[str, str | None]:
    """'owner/repo' or 'owner/repo:FILE' (a .gguf name or a quantization such as Q4_K_M)."""
    repo, _, selector = spec.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise PullError(f"{spec!r} is not a hub model; use OWNER/REPO or OWNER/REPO:FILE, "
                        "e.g. bartowski/Qwen_Qwen3-8B-GGUF:Q4_K_M")
    return repo, (selector or None)


def _remote_files(repo: str, endpoint: str | None, token: str | None) -> list[RemoteFile]:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo, files_metadata=True)
    except RepositoryNotFoundError:
        raise RepoNotFoundError(f"{repo} was not found on {endpoint or 'the hub'} (or it is private: "
                        "set HF_TOKEN)") from None
    except HfHubHTTPError as exc:
        raise DownloadError(f"the hub did not list {repo}: {str(exc).splitlines()[0]}") from None
    except _transport_errors() as exc:
        raise DownloadError(f"cannot reach {endpoint or 'the hub'} to list {repo}: {exc}; "
                            "check the network or HF_ENDPOINT") from None
    files = []
    for sibling in info.siblings or []:
        lfs = sibling.lfs
        files.append(RemoteFile(sibling.rfilename, sibling.size,
                                getattr(lfs, "sha256", None) if lfs else None))
    return files


def choose_files(repo: str, selector: str | None, files: list[RemoteFile], *,
                 preferred: str | None = None) -> list[RemoteFile]:
    """The files to fetch: one GGUF (named, or picked by quantization), or an HF directory.
    preferred: the quantization to take when no selector names one and the repo has several
    (Ollama's hf.co names default to Q4_K_M)."""
    ggufs = [f for f in files if f.name.endswith(".gguf")]
    if not selector and preferred and len(ggufs) > 1 and \
            len([f for f in ggufs if _tag_pattern(preferred).search(Path(f.name).name)]) == 1:
        selector = preferred
    if selector:
        if selector.endswith(".gguf"):
            picked = [f for f in ggufs if f.name == selector or f.name.endswith("/" + selector)]
        else:
            tag = _tag_pattern(selector)
            picked = [f for f in ggufs if tag.search(Path(f.name).name)]
        if len(picked) != 1:
            names = ", ".join(Path(f.name).name for f in ggufs) or "none"
            what = "matches none" if not picked else "matches several"
            raise PullError(f"{selector!r} {what} of {repo}'s GGUF files ({names}); "
                            f"name one as {repo}:FILE")
        return _whole(repo, picked[0])
    file_names = {f.name for f in files}
    if "config.json" in file_names and any(n.endswith(".safetensors") for n in file_names):
        return [f for f in files if _is_hf_file(f.name)]
    if len(ggufs) == 1:
        return _whole(repo, ggufs[0])
    if ggufs:
        choices = ", ".join(sorted(Path(f.name).name for f in ggufs))
        raise PullError(f"{repo} has several GGUF files; pick one as {repo}:FILE or "
                        f"{repo}:Q4_K_M ({choices})")
    raise PullError(f"{repo} has neither GGUF files nor config.json with safetensors weights")


@functools.cache
def _transport_errors() -> tuple[type[Exception], ...]:
    """The HTTP client's network errors: huggingface_hub 1.x uses httpx, 2.x httpx2."""
    errors: list[type[Exception]] = []
    for module in ("httpx", "httpx2"):
        try:
            errors.append(__import__(module).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _tag_pattern(quantization: str) -> re.Pattern[str]:
    """Q4_K_M as a whole word of a file name (not the Q4_K_M of IQ4_K_M...)."""
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(quantization)}(?![A-Za-z0-9])",
                      re.IGNORECASE)


def _whole(repo: str, file: RemoteFile) -> list[RemoteFile]:
    if _SPLIT_GGUF.search(file.name):
        raise PullError(f"{file.name} is one part of a split GGUF, which Strata cannot load "
                        f"yet; pick a single-file quantization of {repo}")
    return [file]


def _is_hf_file(name: str) -> bool:
    from fnmatch import fnmatch

    return "/" not in name and any(fnmatch(name, pattern) for pattern in HF_PATTERNS)


def _sha256(path: Path, cancel: threading.Event | None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            _check_cancel(cancel)
            digest.update(chunk)
    return digest.hexdigest()


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise PullCancelled("the pull was cancelled")


def pull(spec: str, models_dir: Path | None = None, *, progress: bool = True,
         on_progress: ProgressCallback | None = None, cancel: threading.Event | None = None,
         preferred: str | None = None) -> Path:
    """Fetch spec into models_dir/OWNER/REPO; returns the GGUF file or the directory.

    The endpoint is HF_ENDPOINT (default huggingface.co) and the token HF_TOKEN, as for every
    Hugging Face tool. A file whose SHA-256 differs from the hub's record is deleted and
    reported. progress: huggingface_hub's console bar; on_progress: called (on this thread)
    as bytes arrive; cancel: set it from another thread to stop with PullCancelled between
    chunks (huggingface_hub deletes the partial file; files already complete stay).
    preferred: see choose_files.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    repo, selector = parse_spec(spec)
    endpoint = os.environ.get("HF_ENDPOINT") or None
    token = os.environ.get("HF_TOKEN") or None
    files = choose_files(repo, selector, _remote_files(repo, endpoint, token),
                         preferred=preferred)
    target = (models_dir or model_cache_dir()) / repo
    target.mkdir(parents=True, exist_ok=True)
    network_errors: tuple[type[Exception], ...] = (OSError, *_transport_errors())
    for index, file in enumerate(files):
        _check_cancel(cancel)
        report = functools.partial(PullProgress, file, file_index=index, num_files=len(files))
        if on_progress is not None:
            on_progress(report("downloading", 0, file.size_bytes))
        bar = _bar_class(progress, on_progress, report, cancel)
        try:
            local = Path(hf_hub_download(repo, file.name, local_dir=target, endpoint=endpoint,
                                         token=token, tqdm_class=bar))
        except HfHubHTTPError as exc:
            raise DownloadError(f"downloading {file.name} of {repo} failed: "
                                f"{str(exc).splitlines()[0]}") from None
        except network_errors as exc:  # a full disk, a connection gone for good
            raise DownloadError(f"downloading {file.name} of {repo} failed: {exc}") from None
        if file.sha256:
            size_bytes = local.stat().st_size
            if on_progress is not None:
                on_progress(report("verifying", size_bytes, size_bytes))
            if _sha256(local, cancel) != file.sha256:
                local.unlink()
                raise PullError(f"{file.name} of {repo} arrived corrupted (SHA-256 differs from "
                                "the hub's); it was deleted, pull again")
    if len(files) == 1 and files[0].name.endswith(".gguf"):
        return target / files[0].name
    return target


def _bar_class(progress: bool, on_progress: ProgressCallback | None,
               report: Callable[..., PullProgress], cancel: threading.Event | None) -> type | None:
    """The tqdm class huggingface_hub draws its bar with: its own (progress, nobody listening),
    else one that reports each chunk to on_progress and stops on cancel, drawn or not."""
    if progress and on_progress is None and cancel is None:
        return None
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Reporting(hf_tqdm):
        def __init__(self, *args, **kwargs):
            if not progress:
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.done_bytes = int(kwargs.get("initial") or 0)  # counted here: a disabled bar
            self.total_bytes = kwargs.get("total")  # keeps no count of its own

        def update(self, n=1):
            _check_cancel(cancel)  # raised inside the download loop, which then stops
            self.done_bytes += int(n or 0)
            if on_progress is not None:
                on_progress(report("downloading", self.done_bytes, self.total_bytes))
            return super().update(n)

    return Reporting
