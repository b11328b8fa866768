"""Sparse upcycling: a mixture-of-experts model grown from a dense one, then trained (upcycle.py)."""
