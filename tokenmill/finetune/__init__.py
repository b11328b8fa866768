"""Fine-tuning a served model: LoRA adapters (lora) trained from JSON-lines records (data)."""

from tokenmill.finetune.lora import LoRATrainConfig, LoRATrainResult, TrainableLoRA, train_lora

__all__ = ["LoRATrainConfig", "LoRATrainResult", "TrainableLoRA", "train_lora"]
