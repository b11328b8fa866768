"""Device kernels behind small Python entry points; callers fall back to PyTorch ops when a
kernel is not available on the device at hand."""
