"""`strata pull REPO[:FILE]`: fetch a GGUF file or a Hugging Face model from the hub.

huggingface_hub lists the repository (each file's size and SHA-256), builds the URLs and the
headers (HF_ENDPOINT, HF_TOKEN) and keeps the HTTP session; transfer.py moves the bytes, so an
interrupted pull resumes on the next one and each file is checked against the hub's SHA-256.
Callers without a console (the Ollama API's /api/pull, the tray) follow a pull through
`on_progress` and stop it through `cancel`.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.library.hub_names import check_commit, check_repo_id, inside
from strata.library.pull_errors import (
    BadListingError,
    DownloadError,
    HubOfflineError,
    PullCancelled,
    PullError,
    RepoNotFoundError,
)
from strata.library.transfer import Source, check_cancel, fetch, offline_error, transport_errors
from strata.paths import model_cache_dir

__all__ = ["BadListingError", "DownloadError", "HubOfflineError", "PullCancelled", "PullError",
           "PullProgress", "RemoteFile", "RepoNotFoundError", "choose_files", "parse_spec",
           "pull"]

# What a Hugging Face directory needs to load; weights, tokenizer and templates.
HF_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "*.safetensors",
               "*.safetensors.index.json")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size_bytes: int | None
    sha256: str | None  # the hub records it for files kept in LFS
    blob_id: str | None = None  # the git blob id: what a file outside LFS is known by


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
    """'owner/repo' or 'owner/repo:FILE' (a .gguf name or a quantization such as Q4_K_M); a
    repository id the hub would refuse is a PullError (it becomes the library's folder)."""
    repo, _, selector = spec.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise PullError(f"{spec!r} is not a hub model; use OWNER/REPO or OWNER/REPO:FILE, "
                        "e.g. bartowski/Qwen_Qwen3-8B-GGUF:Q4_K_M")
    check_repo_id(repo)
    return repo, (selector or None)


def _remote_files(repo: str, endpoint: str | None,
                  token: str | None) -> tuple[str | None, list[RemoteFile]]:
    """The commit the listing is of, and the repository's files."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    hub = endpoint or "the hub"
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo, files_metadata=True)
    except RepositoryNotFoundError:
        raise RepoNotFoundError(f"{repo} was not found on {hub} (or it is private: "
                                "set HF_TOKEN)") from None
    except HfHubHTTPError as exc:
        raise DownloadError(f"the hub did not list {repo}: {str(exc).splitlines()[0]}") from None
    except OfflineModeIsEnabled:
        raise offline_error(f"list {repo}") from None
    except transport_errors() as exc:
        raise DownloadError(f"cannot reach {hub} to list {repo}: {exc}; "
                            "check the network or HF_ENDPOINT") from None
    except HFValidationError as exc:  # parse_spec checks first; a newer rule of the library
        raise PullError(f"{repo!r} is not a hub repository id: {exc}") from None
    except (ValueError, TypeError, KeyError) as exc:  # JSON that is no model's listing
        raise BadListingError(f"{hub}'s answer for {repo} is not a model listing "
                              f"({type(exc).__name__}); check HF_ENDPOINT") from None
    check_commit(info.sha, repo)
    files = []
    for sibling in info.siblings or []:
        lfs = sibling.lfs
        if not isinstance(sibling.rfilename, str):
            raise BadListingError(f"the hub's listing of {repo} names a file "
                                  f"{sibling.rfilename!r}, which is not a file name; refused")
        if sibling.size is not None and (not isinstance(sibling.size, int) or sibling.size < 0):
            raise BadListingError(f"the hub's listing of {repo} gives {sibling.rfilename!r} "
                                  f"the size {sibling.size!r}; refused")
        files.append(RemoteFile(sibling.rfilename, sibling.size,
                                getattr(lfs, "sha256", None) if lfs else None,
                                sibling.blob_id))
    return info.sha, files


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


def pull(spec: str, models_dir: Path | None = None, *, progress: bool = True,
         on_progress: ProgressCallback | None = None, cancel: threading.Event | None = None,
         preferred: str | None = None) -> Path:
    """Fetch spec into models_dir/OWNER/REPO; returns the GGUF file or the directory.

    The endpoint is HF_ENDPOINT (default huggingface.co) and the token HF_TOKEN, as for every
    Hugging Face tool. A file stopped halfway (cancel, a dropped connection, a killed process)
    resumes on the next pull (transfer.py); a file whose SHA-256 differs from the hub's record
    is deleted and reported. progress: a console bar per file; on_progress: called (on this
    thread) as bytes arrive, from the resumed offset on; cancel: set it from another thread to
    stop with PullCancelled between chunks (the part stays for the next pull; files already
    complete stay). preferred: see choose_files.
    """
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    repo, selector = parse_spec(spec)
    endpoint = os.environ.get("HF_ENDPOINT") or None
    token = os.environ.get("HF_TOKEN") or None
    commit, listed = _remote_files(repo, endpoint, token)
    files = choose_files(repo, selector, listed, preferred=preferred)
    target = (models_dir or model_cache_dir()) / repo
    for file in files:  # every name checked before a folder is made
        inside(target, file.name, repo)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DownloadError(f"cannot create {target}: {exc}") from None
    headers = build_hf_headers(token=token, library_name="strata")
    for index, file in enumerate(files):
        check_cancel(cancel)
        # pinned to the listed commit, so the bytes are those of the SHA-256 it records
        url = hf_hub_url(repo, file.name, revision=commit, endpoint=endpoint)
        source = Source(url, headers, identity=file.sha256 or file.blob_id or f"{commit}:{url}",
                        size_bytes=file.size_bytes, sha256=file.sha256, repo=repo,
                        label=f"{file.name} of {repo}")
        report = functools.partial(PullProgress, file, file_index=index, num_files=len(files))
        size_bytes = file.size_bytes or 0
        verified = functools.partial(on_progress, report("verifying", size_bytes, size_bytes)) \
            if on_progress else None
        with _Progress(file, progress, on_progress, report) as on_bytes:
            fetch(source, target, file.name, on_bytes=on_bytes, on_verify=verified,
                  cancel=cancel)
    if len(files) == 1 and files[0].name.endswith(".gguf"):
        return target / files[0].name
    return target


class _Progress:
    """Byte counts of one file to the console bar (tqdm, as huggingface_hub draws it) and to
    on_progress."""

    def __init__(self, file: RemoteFile, progress: bool, on_progress: ProgressCallback | None,
                 report: Callable[..., PullProgress]):
        self.file = file
        self.progress = progress
        self.on_progress = on_progress
        self.report = report
        self.bar: Any = None

    def __enter__(self) -> Callable[[int], None]:
        return self.on_bytes

    def on_bytes(self, done_bytes: int) -> None:
        if self.progress:
            if self.bar is None:
                from huggingface_hub.utils import tqdm as hf_tqdm

                self.bar = hf_tqdm(total=self.file.size_bytes, initial=done_bytes, unit="B",
                                   unit_scale=True, unit_divisor=1024,
                                   desc=Path(self.file.name).name)
            else:
                self.bar.update(done_bytes - self.bar.n)
        if self.on_progress is not None:
            self.on_progress(self.report("downloading", done_bytes, self.file.size_bytes))

    def __exit__(self, *exc_info: object) -> None:
        if self.bar is not None:
            self.bar.close()
