"""What the routers of an MoE model did: tokens per expert, dropped assignments, router entropy.

The model's SparseMoE layers record into one :class:`ExpertStats` (``CausalLM.expert_stats``)
as they run; the engine drains it once per step into a :class:`MoEStepStats` for ``/metrics``,
``tokenmill bench offline`` and the expert-load plot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.models.moe import routing_entropy


@dataclass(frozen=True)
class MoEStepStats:
    """One step's routing, per layer and expert (layers without experts: all zeros)."""

    tokens_per_expert: list[list[int]]
    """[layer][expert]: assignments the router made (each token counts once per chosen expert)."""
    dropped_per_expert: list[list[int]]
    """[layer][expert]: of those, how many capacity dropped (always 0 in no-drop mode)."""
    entropy_sum: float
    """Sum over (token, MoE layer) of the router distribution's entropy, in nats."""
    routed_tokens: int
    """(token, MoE layer) pairs routed: entropy_sum / routed_tokens is the mean entropy."""

    def plus(self, other: MoEStepStats) -> MoEStepStats:
        """Both steps' counts together (the engine's running totals)."""
        add = lambda a, b: [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]  # noqa: E731
        return MoEStepStats(add(self.tokens_per_expert, other.tokens_per_expert),
                            add(self.dropped_per_expert, other.dropped_per_expert),
                            self.entropy_sum + other.entropy_sum, self.routed_tokens + other.routed_tokens)

    @property
    def dropped(self) -> int:
        return sum(map(sum, self.dropped_per_expert))

    @property
    def mean_entropy(self) -> float:
        return self.entropy_sum / self.routed_tokens if self.routed_tokens else 0.0


class ExpertStats:
    """Counters the SparseMoE layers of one model add to, drained once per step."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self._reset(torch.device("cpu"))

    def _reset(self, device: torch.device) -> None:
        self.routed = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64, device=device)
        self.dropped = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64, device=device)
        self.entropy = torch.zeros((), dtype=torch.float64, device=device)
        self.tokens = 0

    def record(self, layer: int, ids: torch.Tensor, keep: torch.Tensor | None, scores: torch.Tensor) -> None:
        """One layer's routing of a step: expert ids [T, k], kept mask [T, k] (None: all kept),
        router scores [T, experts]."""
        if self.routed.device != ids.device:
            self._reset(ids.device)
        self.routed[layer] += torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        if keep is not None:
            self.dropped[layer] += torch.bincount(ids[~keep], minlength=self.num_experts)
        self.entropy += routing_entropy(scores).sum()
        self.tokens += ids.shape[0]

    def record_layers(self, layers: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor,
                      scores: torch.Tensor) -> None:
        """:meth:`record` of M layers' routing at once (no drops): ``layers`` int64 [M] their
        indices, ``offsets`` [M, 1, 1] = m * experts, ids [M, B, k], scores [M, B, experts]. The
        same counts; the entropy summed in one float32 sum (per layer: equal to rounding)."""
        if self.routed.device != ids.device:
            self._reset(ids.device)
        m, experts = ids.shape[0], scores.shape[-1]
        per_layer = torch.bincount((ids + offsets).view(-1), minlength=m * experts)
        self.routed.index_add_(0, layers, per_layer.view(m, experts))
        self.entropy += routing_entropy(scores.view(-1, experts)).sum()
        self.tokens += m * ids.shape[1]

    def drain(self) -> MoEStepStats | None:
        """What was recorded since the last drain (None: nothing routed), and start again."""
        if not self.tokens:
            return None
        out = MoEStepStats(self.routed.tolist(), self.dropped.tolist(), float(self.entropy), self.tokens)
        self._reset(self.routed.device)
        return out


def plot_expert_load(load: list[list[float]], path: Path, title: str) -> Path | None:
    """A layers x experts heatmap of each expert's share of its layer's routed tokens."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * len(load[0]), 1.5 + 0.22 * len(load)))
    image = ax.imshow(load, aspect="auto", cmap="viridis", vmin=0)
    ax.set(xlabel="expert", ylabel="MoE layer")
    ax.set_title(title, fontsize=8, wrap=True)
    fig.colorbar(image, ax=ax, label="share of routed tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
