"""Tests of tokenmill.benchmark (a package, so its module names cannot clash with other test folders)."""
