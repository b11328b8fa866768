"""LoRA fine-tuning: ``tokenmill lora train BASE --data FILE.jsonl --rank R --out DIR``.

The base model stays frozen, in whatever form it was loaded (float, or quantized: QLoRA, the
quantized layers passing gradients to their inputs through their dequantized weights); only the
adapter's A and B train. The adapter runs through the same layer hook as serving
(``tokenmill.lora.slots``): one slot, every token in it, on the PyTorch path that records gradients.

    A [r, in]   initialised as PEFT does (Kaiming-uniform, a = sqrt 5)
    B [out, r]  zeros, so training starts from the base model's output
    update      (alpha / r) B A x, or alpha / sqrt(r) with rsLoRA

The result is written as a PEFT adapter (``adapter_config.json``, ``adapter_model.safetensors``)
that PEFT and tokenmill load; the run directory keeps checkpoints (resume by running the same
command again), the loss log and its plot.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.errors import InvalidParameterError
from tokenmill.finetune.data import IGNORE, Example, collate, read_examples, sample_batches, split
from tokenmill.lora.adapter import MAX_RANK, PROJECTIONS, projection_shape
from tokenmill.lora.slots import FUSED_MODULES, LoRABatch, ModuleStack
from tokenmill.models.base import CausalLM
from tokenmill.models.builder import LoadedModel
from tokenmill.quantization.qat import training_logits
from tokenmill.training.trainer import TrainConfig, Trainer, TrainLog

HF_NAMES = {"attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
            "attn.o": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
            "mlp.down": "mlp.down_proj"}
"""Canonical projection -> its module's name in an HF decoder layer (PEFT's key)."""


@dataclass(frozen=True)
class LoRATrainConfig:
    """What ``tokenmill lora train`` trains, and on what."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = PROJECTIONS
    """Canonical projections adapted (``attn.q`` ... ``mlp.down``)."""
    use_rslora: bool = False
    """Scale by alpha / sqrt(rank) instead of alpha / rank."""
    batch_size: int = 8
    max_len: int = 512
    """Tokens per record at most (longer ones keep the prompt's tail and the completion's head)."""
    eval_fraction: float = 0.1
    """Records held out for the evaluation loss."""
    eval_every: int = 50
    """Steps between evaluations (and one at the end)."""
    seed: int = 0
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=200, lr=2e-4, warmup_steps=10))

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_RANK:
            raise InvalidParameterError(f"rank must be in 1..{MAX_RANK}, got {self.rank}")
        unknown = sorted(set(self.targets) - set(PROJECTIONS))
        if unknown or not self.targets:
            raise InvalidParameterError(f"targets: unknown projection(s) {unknown or 'none given'}; "
                                        f"choose from {', '.join(PROJECTIONS)}")
        if not 0 <= self.eval_fraction < 1 or self.batch_size < 1 or self.max_len < 2 or self.eval_every < 0:
            raise InvalidParameterError("eval_fraction must be in [0, 1), batch_size >= 1, max_len >= 2, "
                                        "eval_every >= 0")

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


class TrainableLoRA(nn.Module):
    """One adapter's A and B per (layer, projection), as trainable parameters."""

    def __init__(self, cfg: ModelConfig, config: LoRATrainConfig) -> None:
        super().__init__()
        self.model_config, self.config = cfg, config
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        for layer in range(cfg.num_layers):
            for projection in config.targets:
                out, inp = projection_shape(cfg, projection)
                a = torch.empty(config.rank, inp)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))
                key = _key(layer, projection)
                self.A[key], self.B[key] = nn.Parameter(a), nn.Parameter(torch.zeros(out, config.rank))

    def stacks(self) -> dict[str, ModuleStack]:
        """The adapter as serving stacks of one slot (zeros for the parts of a fused module it does
        not target), built from the parameters so that gradients reach them."""
        cfg, rank, scaling = self.model_config, self.config.rank, self.config.scaling
        stacks = {}
        for layer in range(cfg.num_layers):
            for module, parts in FUSED_MODULES.items():
                if not any(p in self.config.targets for p in parts):
                    continue
                a_parts, b_parts, bounds = [], [], [0]
                for part in parts:
                    out, inp = projection_shape(cfg, part)
                    key = _key(layer, part)
                    a_parts.append(self.A[key] if key in self.A else self.A[next(iter(self.A))].new_zeros(rank, inp))
                    b_parts.append(self.B[key] * scaling if key in self.B else a_parts[-1].new_zeros(out, rank))
                    bounds.append(bounds[-1] + out)
                stacks[f"layers.{layer}.{module}"] = ModuleStack(torch.stack(a_parts)[None], torch.cat(b_parts)[None],
                                                                 torch.tensor(bounds), bounds)
        return stacks

    def batch(self, num_tokens: int, device: torch.device) -> LoRABatch:
        """Every one of ``num_tokens`` tokens in the adapter's one slot."""
        return LoRABatch(self.stacks(), torch.zeros(num_tokens, dtype=torch.int32, device=device))

    def save(self, out_dir: str | Path, base_model: str) -> Path:
        """Write the adapter as PEFT writes one: adapter_model.safetensors and adapter_config.json."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for key in self.A:
            layer, projection = _unkey(key)
            prefix = f"base_model.model.model.layers.{layer}.{HF_NAMES[projection]}"
            tensors[f"{prefix}.lora_A.weight"] = self.A[key].detach().float().contiguous()
            tensors[f"{prefix}.lora_B.weight"] = self.B[key].detach().float().contiguous()
        save_file(tensors, str(out / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                  "r": self.config.rank, "lora_alpha": self.config.alpha, "lora_dropout": 0.0, "bias": "none",
                  "use_rslora": self.config.use_rslora, "fan_in_fan_out": False, "init_lora_weights": True,
                  "target_modules": sorted(HF_NAMES[p].rsplit(".", 1)[1] for p in self.config.targets),
                  "inference_mode": True}
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return out


def _key(layer: int, projection: str) -> str:
    return f"{layer}_{projection.replace('.', '_')}"


def _unkey(key: str) -> tuple[int, str]:
    layer, projection = key.split("_", 1)
    return int(layer), projection.replace("_", ".", 1)


def lora_loss(model: CausalLM, lora: TrainableLoRA, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the labelled positions of a batch, with the adapter applied."""
    b, s = ids.shape
    hidden = training_logits(model, ids, lora=lora.batch(b * s, ids.device), hidden_only=True)
    keep = labels.reshape(-1) != IGNORE
    logits = model.compute_logits(hidden[keep])
    return nn.functional.cross_entropy(logits.float(), labels.reshape(-1)[keep])


@torch.no_grad()
def eval_loss(model: CausalLM, lora: TrainableLoRA, examples: list[Example], batch_size: int, pad_id: int) -> float:
    """Mean cross-entropy per labelled token over ``examples``."""
    device = model.embed.weight.device
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        ids, labels = collate(examples[i:i + batch_size], pad_id, device)
        n = int((labels != IGNORE).sum())
        total += lora_loss(model, lora, ids, labels).item() * n
        count += n
    return total / max(count, 1)


@dataclass
class LoRATrainResult:
    adapter_dir: Path
    log: TrainLog
    eval_loss_before: float | None
    """Held-out loss of the base model (the adapter's B is zero at the start)."""
    eval_loss_after: float | None
    num_train: int
    num_eval: int


def train_lora(loaded: LoadedModel, data: str | Path, out_dir: str | Path, config: LoRATrainConfig,
               progress: bool = True) -> LoRATrainResult:
    """Train an adapter on ``loaded`` (frozen) from the records in ``data``; write it to ``out_dir``
    (checkpoints under ``out_dir/run``: a second call with the same arguments resumes)."""
    model, tokenizer = loaded.model, loaded.tokenizer
    model.requires_grad_(False)
    examples = read_examples(data, tokenizer, config.max_len)
    train, held = split(examples, config.eval_fraction, config.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    torch.manual_seed(config.seed)
    device = model.embed.weight.device
    lora = TrainableLoRA(loaded.config, config).to(device)
    out = Path(out_dir)
    trainer = Trainer({"lora": lora}, config.train, out / "run", desc="lora train", progress=progress)
    resumed = trainer.resume()
    before = eval_loss(model, lora, held, config.batch_size, pad_id) if held and not resumed else None
    batches = sample_batches(train, config.train.steps * config.train.grad_accum, config.batch_size, config.seed,
                             pad_id, device)

    def after_step(step: int) -> dict[str, float] | None:
        if held and config.eval_every and (step % config.eval_every == 0 or step == config.train.steps):
            return {"eval_step": step, "eval_loss": eval_loss(model, lora, held, config.batch_size, pad_id)}
        return None

    log = trainer.fit(batches, lambda batch: (lora_loss(model, lora, *batch), {}), resume=False,
                      after_step=after_step)
    lora.save(out, loaded.source.name)
    (out / "train_log.json").write_text(json.dumps({"config": _jsonable(config), "log": log.values,
                                                    "eval_loss_before": before, "num_train": len(train),
                                                    "num_eval": len(held)}, indent=1))
    after = log.values.get("eval_loss", [None])[-1]
    return LoRATrainResult(out, log, before, after, len(train), len(held))


def _jsonable(config: LoRATrainConfig) -> dict:
    data = asdict(config)
    data["targets"] = list(config.targets)
    return data



def plot_losses(values: dict[str, list[float]], path: Path) -> Path | None:
    """Training loss per step and held-out loss per evaluation -> the PNG, or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(values["loss"]) + 1), values["loss"], label="training loss", alpha=0.7)
    if "eval_loss" in values:
        ax.plot(values["eval_step"], values["eval_loss"], marker="o", label="held-out loss")
    ax.set(xlabel="step", ylabel="cross-entropy (nats per token)", title="LoRA training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
