"""Pruning: smaller or sparser models from the ones tokenmill serves."""
