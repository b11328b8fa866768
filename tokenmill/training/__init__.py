"""Training loops tokenmill runs on its own models: one trainer (trainer.py) that QAT, speculative
heads and later distillation, LoRA and upcycling share."""
