"""`strata pull REPO[:FILE]`: fetch a GGUF file or a Hugging Face model from the hub.

huggingface_hub does the transfer (it is what the hub's own tools use: resumable downloads,
HF_ENDPOINT and HF_TOKEN honoured, progress bars), so Strata only chooses the files and checks
each file's SHA-256 against the hub's record of it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
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


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size_bytes: int | None
    sha256: str | None  # the hub records it for files kept in LFS


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
        raise PullError(f"{repo} was not found on {endpoint or 'the hub'} (or it is private: "
                        "set HF_TOKEN)") from None
    except HfHubHTTPError as exc:
        raise PullError(f"the hub did not list {repo}: {str(exc).splitlines()[0]}") from None
    files = []
    for sibling in info.siblings or []:
        lfs = sibling.lfs
        files.append(RemoteFile(sibling.rfilename, sibling.size,
                                getattr(lfs, "sha256", None) if lfs else None))
    return files


def choose_files(repo: str, selector: str | None, files: list[RemoteFile]) -> list[RemoteFile]:
    """The files to fetch: one GGUF (named, or picked by quantization), or an HF directory."""
    ggufs = [f for f in files if f.name.endswith(".gguf")]
    if selector:
        if selector.endswith(".gguf"):
            picked = [f for f in ggufs if f.name == selector or f.name.endswith("/" + selector)]
        else:
            tag = re.compile(rf"(?<![A-Za-z0-9]){re.escape(selector)}(?![A-Za-z0-9])",
                             re.IGNORECASE)
            picked = [f for f in ggufs if tag.search(Path(f.name).name)]
        if len(picked) != 1:
            names = ", ".join(Path(f.name).name for f in ggufs) or "none"
            what = "matches none" if not picked else "matches several"
            raise PullError(f"{selector!r} {what} of {repo}'s GGUF files ({names}); "
                            f"name one as {repo}:FILE")
        return _whole(repo, picked[0])
    names = {f.name for f in files}
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        return [f for f in files if _is_hf_file(f.name)]
    if len(ggufs) == 1:
        return _whole(repo, ggufs[0])
    if ggufs:
        choices = ", ".join(sorted(Path(f.name).name for f in ggufs))
        raise PullError(f"{repo} has several GGUF files; pick one as {repo}:FILE or "
                        f"{repo}:Q4_K_M ({choices})")
    raise PullError(f"{repo} has neither GGUF files nor config.json with safetensors weights")


def _whole(repo: str, file: RemoteFile) -> list[RemoteFile]:
    if _SPLIT_GGUF.search(file.name):
        raise PullError(f"{file.name} is one part of a split GGUF, which Strata cannot load "
                        f"yet; pick a single-file quantization of {repo}")
    return [file]


def _is_hf_file(name: str) -> bool:
    from fnmatch import fnmatch

    return "/" not in name and any(fnmatch(name, pattern) for pattern in HF_PATTERNS)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def pull(spec: str, models_dir: Path | None = None, *, progress: bool = True,
         on_file: Callable[[RemoteFile], None] | None = None) -> Path:
    """Fetch spec into models_dir/OWNER/REPO; returns the GGUF file or the directory.

    The endpoint is HF_ENDPOINT (default huggingface.co) and the token HF_TOKEN, as for every
    Hugging Face tool. A file whose SHA-256 differs from the hub's record is deleted and
    reported; an interrupted download resumes on the next pull.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    repo, selector = parse_spec(spec)
    endpoint = os.environ.get("HF_ENDPOINT") or None
    token = os.environ.get("HF_TOKEN") or None
    files = choose_files(repo, selector, _remote_files(repo, endpoint, token))
    target = (models_dir or model_cache_dir()) / repo
    target.mkdir(parents=True, exist_ok=True)
    for file in files:
        if on_file is not None:
            on_file(file)
        try:
            local = Path(hf_hub_download(repo, file.name, local_dir=target, endpoint=endpoint,
                                         token=token,
                                         tqdm_class=None if progress else _silent_tqdm()))
        except HfHubHTTPError as exc:
            raise PullError(f"downloading {file.name} of {repo} failed: "
                            f"{str(exc).splitlines()[0]}") from None
        if file.sha256 and _sha256(local) != file.sha256:
            local.unlink()
            raise PullError(f"{file.name} of {repo} arrived corrupted (SHA-256 differs from the "
                            "hub's); it was deleted, pull again")
    if len(files) == 1 and files[0].name.endswith(".gguf"):
        return target / files[0].name
    return target


@functools.cache
def _silent_tqdm() -> type:
    """A tqdm that shows nothing, for pulls without a console (the tray, the Ollama API)."""
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent
