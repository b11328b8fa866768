"""The kernel builder's directory (one per checkout: keyed by the sources' absolute path as well as
their content) and ``python -m tokenmill.kernels``, the build ahead of time that ``make install`` runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tokenmill.kernels import __main__ as build_command
from tokenmill.kernels import cpu_ops as builder
from tokenmill.kernels import dispatch

ROOT = Path(__file__).resolve().parents[2]


def _checkout(root: Path) -> Path:
    """A copy of this checkout's kernel sources under ``root`` (what a second checkout has)."""
    target = root / "tokenmill" / "kernels" / "cpu"
    shutil.copytree(builder.SOURCE_DIR, target)
    return target


def test_two_checkouts_get_two_build_directories_and_each_keeps_its_own(tmp_path):
    a, b = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    assert builder.build_dir(a) != builder.build_dir(b)  # same content, different paths
    assert builder.build_dir(a) == builder.build_dir(a)
    assert builder.build_dir(a) == builder.build_dir(tmp_path / "b" / ".." / "a" / "tokenmill" / "kernels" / "cpu")
    assert builder.build_dir() == builder.build_dir(builder.SOURCE_DIR) == builder.build_dir(builder.SOURCE_DIR)
    assert builder.build_dir(a).parent == builder.build_dir().parent  # all under the one kernels cache
    before = builder.build_dir(a)
    with open(a / "simd.h", "a") as f:
        f.write("\n// edited\n")
    assert builder.build_dir(a) != before  # the content is still in the key


def test_the_sources_are_found_by_absolute_path():
    assert builder.SOURCE_DIR.is_absolute() and all(s.is_file() for s in builder.SOURCES + builder.HEADERS)
    assert set(builder.SOURCES) | set(builder.HEADERS) >= set(builder.SOURCE_DIR.glob("*.cpp"))


@pytest.fixture
def kernels_on(monkeypatch, tmp_path):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty cache: nothing built yet
    return monkeypatch


def test_the_command_fails_with_the_compilers_error(kernels_on, capsys):
    def fail():
        raise RuntimeError("Error building extension 'tokenmill_cpu_kernels': decoder.cpp:12:3: error: expected ';'")

    kernels_on.setattr(builder, "build", fail)
    assert build_command.main() == 1
    out = capsys.readouterr()
    assert "build failed" in out.err and "decoder.cpp:12:3: error: expected ';'" in out.err
    assert str(builder.build_dir()) in out.err


def test_the_command_says_where_and_how_long(kernels_on, capsys):
    module = types.SimpleNamespace(int4_linear_fast=lambda: True, bf16_linear_fast=lambda: False,
                                   sparse_linear_fast=lambda: True)
    calls = []
    kernels_on.setattr(builder, "build", lambda: calls.append(1) or module)
    assert build_command.main() == 0 and calls == [1]
    out = capsys.readouterr().out
    assert f"CPU kernels: built in {builder.build_dir()} (" in out and " s)" in out
    assert "int4 yes" in out and "bf16 no" in out and "sparse yes" in out


def test_the_command_builds_nothing_when_off(tmp_path):
    env = dict(os.environ, TOKENMILL_CPU_KERNELS="0", XDG_CACHE_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "tokenmill.kernels"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "CPU kernels: off (TOKENMILL_CPU_KERNELS=0)" in done.stdout
    assert not (tmp_path / "tokenmill" / "kernels").exists()


def test_make_install_builds_the_kernels():
    recipe = (ROOT / "Makefile").read_text().split("\ninstall:", 1)[1].split("\n\n", 1)[0]
    lines = [line.strip() for line in recipe.splitlines()[1:] if not line.strip().startswith("#")]
    assert lines.index("$(PY) -m tokenmill.kernels") > next(i for i, x in enumerate(lines) if "pip install" in x)


def test_a_stale_build_lock_is_removed_and_a_live_one_waited_for(tmp_path, caplog):
    """A build killed mid-way leaves torch's lock file, on which every later build would wait forever:
    one older than the limit is removed (with a warning); a fresh one is waited for until its
    build removes it."""
    import logging
    import threading
    import time

    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 100
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="tokenmill.kernels"):
        builder.wait_for_build_lock(tmp_path, stale_after=50, poll=0.01)
    assert not lock.exists() and "stale kernel build lock" in caplog.text
    lock.touch()
    remover = threading.Timer(0.2, lock.unlink)
    remover.start()
    start = time.monotonic()
    builder.wait_for_build_lock(tmp_path, stale_after=50, poll=0.01)
    assert time.monotonic() - start >= 0.15 and not lock.exists()
    builder.wait_for_build_lock(tmp_path)  # no lock: returns at once

