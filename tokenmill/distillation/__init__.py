"""Distillation: a student trained on a frozen teacher's distributions (soft-label KD, hidden-state
transfer, draft models for speculative decoding, quantization-aware), on corpus text or on text the
teacher writes. ``config.py`` what a run optimizes, ``losses.py`` the terms, ``data.py`` the text,
``distill.py`` the run.

Names load on first use, so that the CLI's parser stays free of torch."""

import importlib

_EXPORTS = {"DistillConfig": "config", "DistillResult": "distill", "distill_models": "distill"}
# (the function ``distill`` stays in its module of the same name: ``tokenmill.distill`` is distill_models)
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"tokenmill.distillation.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
