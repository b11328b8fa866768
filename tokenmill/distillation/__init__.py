"""Distillation: a student trained on a frozen teacher's distributions (soft-label KD, hidden-state
transfer, draft models for speculative decoding, quantization-aware), on corpus text or on text the
teacher writes. ``config.py`` what a run optimizes, ``losses.py`` the terms, ``data.py`` the text,
``distill.py`` the run."""
