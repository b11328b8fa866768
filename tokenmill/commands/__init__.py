"""The ``tokenmill`` subcommands that are not the server's or the benchmarks': one module per
command family (eval, quantize, qat), each an ``add_*_parser`` and a ``cmd_*``; cli.py wires them.

They sit above everything else (the import contract): a command loads models through
tokenmill.loader and calls the library; it holds no logic the library lacks.
"""
