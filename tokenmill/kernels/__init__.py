"""Device kernels behind small Python entry points; callers fall back to PyTorch ops when a
kernel is not available on the device at hand.

    dispatch      which kernels run: decided once per process, asked by every caller
    cpu_ops       the builder of the C++ CPU kernels (cpu/*.cpp), one build per checkout
    __main__      ``python -m tokenmill.kernels``: build them ahead of time (``make install``)
    linear_spec   a linear layer as the one-call CPU decode stack runs it
"""
