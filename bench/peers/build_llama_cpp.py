"""Build llama.cpp's ``llama-server`` and ``llama-bench`` once, into a cache outside the repo.

    python bench/peers/build_llama_cpp.py [--cache ~/.cache/tokenmill/peers] [--jobs 2] [--force]

Debian ships no llama.cpp, but the sdist of ``llama-cpp-python`` (PyPI) vendors the whole tree
(``vendor/llama.cpp``, ``tools/server`` included). Steps, each skipped when already done:

    download   pip download --no-deps --no-binary :all: llama-cpp-python   -> <cache>/
    unpack     the sdist                                                   -> <cache>/src/
    configure  cmake, CPU only, native arch with AMX off (ggml's AMX code dies with SIGILL on
               these VMs; gcc honours an explicit -mno-* whatever its place beside -march=native)
    build      the llama-server and llama-bench targets                    -> <cache>/llama.cpp/bin/

The whole build takes about 12 minutes on 2 cores; it runs under ``nice``. Not run in CI.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

CACHE = Path.home() / ".cache" / "tokenmill" / "peers"
TARGETS = ("llama-server", "llama-bench")
NO_AMX = "-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def binaries(cache: Path = CACHE) -> dict[str, Path]:
    """The built binaries by name; empty when any is missing."""
    found = {name: cache / "llama.cpp" / "bin" / name for name in TARGETS}
    return found if all(p.is_file() and os.access(p, os.X_OK) for p in found.values()) else {}


def build(cache: Path = CACHE, jobs: int = 2, force: bool = False) -> dict[str, Path]:
    """Download, configure and build when needed; returns the binaries or raises RuntimeError."""
    if binaries(cache) and not force:
        return binaries(cache)
    cache.mkdir(parents=True, exist_ok=True)
    source = _unpack(_download(cache), cache / "src") / "vendor" / "llama.cpp"
    if not (source / "tools" / "server").is_dir():
        raise RuntimeError(f"{source} has no tools/server: this llama-cpp-python sdist does not vendor it")
    build_dir = cache / "build"
    cmake = _cmake()
    flags = f"-O3 {NO_AMX}"
    _run([cmake, "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
          "-DGGML_NATIVE=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
          f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
          "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON"])
    _run(["nice", "-n", "19", cmake, "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
          "--target", *TARGETS])
    bin_dir = cache / "llama.cpp" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in TARGETS:
        shutil.copy2(build_dir / "bin" / name, bin_dir / name)
    return binaries(cache)


def _download(cache: Path) -> Path:
    found = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        print("downloading the llama-cpp-python sdist (it vendors llama.cpp)", flush=True)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(cache),
              "llama-cpp-python"])
        found = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download left no llama_cpp_python-*.tar.gz in {cache}")
    return found[-1]


def _unpack(sdist: Path, into: Path) -> Path:
    root = into / sdist.name.removesuffix(".tar.gz")
    if not root.is_dir():
        print(f"unpacking {sdist.name}", flush=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(into, filter="data")
    return root


def gguf_of_hf_dir(model_dir: Path, cache: Path = CACHE, outtype: str = "bf16") -> Path:
    """An HF checkpoint directory (a draft that tokenmill pruned or distilled) as a GGUF file that
    llama.cpp loads, written by llama.cpp's own converter (``convert_hf_to_gguf.py`` of the vendored
    tree, with its ``gguf-py``) once, beside the directory's weights (``DIR.<outtype>.gguf``)."""
    model_dir = Path(model_dir)
    out = model_dir.with_name(f"{model_dir.name}.{outtype}.gguf")
    weights = max((p.stat().st_mtime for p in model_dir.glob("*.safetensors")), default=0)
    if out.is_file() and out.stat().st_mtime >= weights:
        return out
    source = _unpack(_download(cache), cache / "src") / "vendor" / "llama.cpp"
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    print(f"converting {model_dir} -> {out}", flush=True)
    try:
        subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(model_dir), "--outfile", str(out),
                        "--outtype", outtype], check=True, env=env, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}: {exc.stderr[-2000:]}") from exc
    except OSError as exc:
        raise RuntimeError(f"convert_hf_to_gguf.py could not run: {exc}") from exc
    return out


def _cmake() -> str:
    found = shutil.which("cmake")
    if found:
        return found
    print("cmake not found: pip install cmake", flush=True)
    _run([sys.executable, "-m", "pip", "install", "cmake"])
    found = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
    if not Path(found).exists():
        raise RuntimeError("cmake is not available and pip could not install it")
    return found


def _run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise RuntimeError(f"{cmd[0]} failed: {exc}") from exc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--force", action="store_true", help="rebuild even when the binaries exist")
    args = parser.parse_args()
    try:
        built = build(args.cache, args.jobs, args.force)
    except RuntimeError as exc:
        sys.exit(f"llama.cpp not built: {exc}")
    for name, path in built.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
