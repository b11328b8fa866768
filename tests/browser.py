"""Headless Chromium for browser tests: Debian's ``chromium`` driven by Playwright's Python API.

Playwright's own browsers are never used (they would be downloaded; nothing is fetched at test
time): the browser is the system's ``chromium``. Without it, or without the ``playwright``
package, a test skips and says why, except under CI (the environment variable ``CI`` set), where
it fails: ``.ci/run`` installs chromium and the test extras install playwright.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

import pytest


def _missing(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run the browser tests", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def chromium() -> Iterator:
    """A headless Chromium (a Playwright ``Browser``), closed on exit."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install -e '.[test]')")
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        _missing("chromium is not installed (apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, headless=True)
        try:
            yield browser
        finally:
            browser.close()


class WatchedPage:
    """A new page in its own context that records console errors, uncaught exceptions and every
    URL it requests."""

    def __init__(self, browser, viewport: dict | None = None) -> None:
        self.context = browser.new_context(viewport=viewport or {"width": 1400, "height": 1000})
        self.page = self.context.new_page()
        self.console_errors: list[str] = []
        self.page_errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.console_errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.page_errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def __enter__(self) -> WatchedPage:
        return self

    def __exit__(self, *exc) -> None:
        self.context.close()

    def errors(self, expected: tuple[str, ...] = ()) -> list[str]:
        """Console errors and page errors, less console errors containing one of ``expected``."""
        return [e for e in self.console_errors if not any(x in e for x in expected)] + self.page_errors
