from tests.server.conftest import tiny_dir  # noqa: F401 - the tiny checkpoint fixture, shared
