"""This machine's ceilings, measured once, and how close a model's steps come to them.

Ceilings (cached as JSON in ``~/.cache/tokenmill/hardware.json``, one entry per device and thread
count):

* memory bandwidth: the best of a large tensor copy (reads + writes 2x the bytes) and a large sum
  (reads the bytes once), in bytes/s;
* matmul FLOP/s per dtype: ``2 n^3`` per square ``n x n`` matmul, best call.

Per step of a model (see :class:`ModelCost`):

* MBU = (weight bytes + KV bytes read) / step time / memory bandwidth   (the decode-step roofline)
* MFU = 2 * matmul parameters * tokens / step time / peak matmul FLOP/s  (attention FLOPs left out)
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from tokenmill.device import DTYPES
from tokenmill.engine.work import matmul_params

CPU_SIZES = {"bandwidth_bytes": 256 << 20, "matmul_n": 1024}
CUDA_SIZES = {"bandwidth_bytes": 2 << 30, "matmul_n": 8192}


@dataclass
class HardwareCeilings:
    device: str
    """What was measured: the CPU model and thread count, or the CUDA device name."""
    memory_bandwidth: float
    """Bytes per second."""
    copy_bandwidth: float
    read_bandwidth: float
    matmul_flops: dict[str, float]
    """dtype name -> FLOP/s."""
    measured_at: str

    def peak_flops(self, dtype: torch.dtype | str) -> float:
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        if name not in self.matmul_flops:
            raise KeyError(f"no matmul ceiling measured for {name}; known: {', '.join(self.matmul_flops)}")
        return self.matmul_flops[name]


def device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{cpu}:{torch.get_num_threads()} threads"


def _best_seconds(fn: Callable[[], object], device: torch.device, min_time: float, min_calls: int = 3) -> float:
    """The fastest of repeated calls (after one warm-up) until ``min_time`` seconds and ``min_calls`` calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best, spent, calls = float("inf"), 0.0, 0
    while spent < min_time or calls < min_calls:
        start = time.perf_counter()
        fn()
        sync()
        took = time.perf_counter() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
    return best


def measure_bandwidth(device: torch.device, nbytes: int, min_time: float = 0.5) -> tuple[float, float]:
    """(copy, read) bandwidth in bytes/s over a tensor of ``nbytes``."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    copy = 2 * x.nbytes / _best_seconds(lambda: y.copy_(x), device, min_time)
    read = x.nbytes / _best_seconds(lambda: x.sum(), device, min_time)
    return copy, read


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int, min_time: float = 0.5) -> float:
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    return 2 * n ** 3 / _best_seconds(lambda: a @ b, device, min_time)


def measure(device: torch.device, dtypes: Sequence[str] | None = None, bandwidth_bytes: int | None = None,
            matmul_n: int | None = None, min_time: float = 0.5) -> HardwareCeilings:
    sizes = CUDA_SIZES if device.type == "cuda" else CPU_SIZES
    dtypes = dtypes or (("float32", "bfloat16", "float16") if device.type == "cuda" else ("float32", "bfloat16"))
    copy, read = measure_bandwidth(device, bandwidth_bytes or sizes["bandwidth_bytes"], min_time)
    flops = {name: measure_matmul(device, DTYPES[name], matmul_n or sizes["matmul_n"], min_time) for name in dtypes}
    return HardwareCeilings(device_key(device), max(copy, read), copy, read, flops,
                            datetime.now(timezone.utc).isoformat(timespec="seconds"))


def default_cache_path() -> Path:
    from tokenmill.paths import default_cache_dir

    return default_cache_dir() / "hardware.json"


def load_or_measure(device: torch.device, cache_path: Path | None = None, remeasure: bool = False,
                    **measure_kwargs) -> HardwareCeilings:
    """The cached ceilings of this device, measured (and cached) on first use or when asked."""
    path = Path(cache_path) if cache_path else default_cache_path()
    key = device_key(device)
    try:
        cache = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        cache = {}
    if not remeasure and key in cache:
        return HardwareCeilings(**cache[key])
    ceilings = measure(device, **measure_kwargs)
    cache[key] = asdict(ceilings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache, indent=2) + "\n", encoding="utf-8")
    return ceilings


@dataclass(frozen=True)
class ModelCost:
    """What one forward step of a model reads and computes, from its tensors and config."""

    weight_bytes: int
    """Bytes of every parameter and buffer a step reads (an untied embedding is only gathered: left out)."""
    matmul_params: int
    """Weights of matmuls one token runs through, from the architecture: q, k, v, o and the gated
    MLP of every layer (MoE layers: the router, top_k experts and the shared one), and the LM head
    (however the weights are stored, quantized or not)."""
    kv_bytes_per_token: int
    """K and V of one token across all layers."""

    expert_bytes: int = 0
    """MoE models: bytes of one routed expert's weights (a decode step reads only the experts its
    routers picked); 0 for a dense model."""
    routed_experts: int = 0
    """MoE models: routed experts over all layers."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelCost:
        cfg = model.config
        embed = model.embed.weight
        gathered_only = model.lm_head is not None
        seen, weight_bytes = set(), 0
        for t in [*model.parameters(), *model.buffers()]:
            if t.data_ptr() in seen or (gathered_only and t is embed):
                continue
            seen.add(t.data_ptr())
            weight_bytes += t.numel() * t.element_size()
        expert_bytes, routed = 0, 0
        for i in range(cfg.num_layers):
            if cfg.is_moe_layer(i):
                experts = model.layers[i].mlp.experts
                expert_bytes = sum(p.numel() * p.element_size() for p in experts[0].parameters())
                routed += len(experts)
        kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * embed.element_size()
        return cls(weight_bytes, matmul_params(cfg), kv_bytes, expert_bytes, routed)

    def bytes_read(self, kv_tokens: int, active_experts: int | None = None) -> int:
        """Weights and KV a step reads; ``active_experts``: of an MoE model, how many (layer,
        expert) pairs the step's routers picked (None: all)."""
        weights = self.weight_bytes
        if active_experts is not None and self.routed_experts:
            weights -= (self.routed_experts - active_experts) * self.expert_bytes
        return weights + self.kv_bytes_per_token * kv_tokens

    def flops(self, tokens: int) -> int:
        return 2 * self.matmul_params * tokens


def plot_roofline(ceilings: HardwareCeilings, points: Sequence[tuple[str, float, float]], path: str | Path,
                  title: str = "") -> Path:
    """Log-log roofline: one roof per measured dtype, and (label, FLOPs/byte, FLOP/s) points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw = ceilings.memory_bandwidth
    lo = min([0.1] + [p[1] / 4 for p in points if p[1] > 0])
    hi = max([10 * max(ceilings.matmul_flops.values()) / bw] + [p[1] * 4 for p in points])
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(7, 5))
    for name, peak in ceilings.matmul_flops.items():
        ax.plot(xs, [min(peak, bw * x) for x in xs], label=f"roof {name}: {peak / 1e12:.2f} TFLOP/s")
    for label, intensity, achieved in points:
        ax.scatter([intensity], [achieved], zorder=3)
        ax.annotate(label, (intensity, achieved), textcoords="offset points", xytext=(5, 5))
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs / byte)", ylabel="FLOP/s",
           title=title or f"roofline: {ceilings.device}, {bw / 1e9:.1f} GB/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
