"""A headless Chromium for the browser tests: Debian's ``chromium`` + ``chromium-driver`` driven
by Selenium (it never downloads a browser or a driver: both paths are given).

:func:`chromium_or_skip` skips the calling test, saying why, where there is no browser (CI installs
one: ``.ci/run``); a browser that is there but does not start is a failure, not a skip.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

#: Flags known to work in containers without a display, GPU or network.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)
INSTALL = "apt-get install -y chromium chromium-driver"


def _find(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def chromium_or_skip(profile: Path) -> Any:
    """A started headless Chromium (Selenium WebDriver) with a fresh profile in ``profile``."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        reason = "selenium is not installed (pip install -e '.[dev]')"
        print(f"SKIP browser test: {reason}", flush=True)
        pytest.skip(reason)
    browser = _find("chromium", "chromium-browser")
    driver = _find("chromedriver")
    missing = [what for what, path in (("chromium", browser), ("chromedriver", driver)) if not path]
    if missing:
        reason = (
            f"no browser here: {' and '.join(missing)} not found on PATH; install with `{INSTALL}`"
        )
        print(f"SKIP browser test: {reason}", flush=True)
        pytest.skip(reason)
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not try to fetch anything
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(browser)
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(
        service=Service(str(driver), log_output=str(profile.parent / "chromedriver.log")),
        options=opts,
    )


def screenshot(driver: Any, path: Path, width: int = 1400) -> Path:
    """The whole page (not only the window) as a PNG."""
    height = int(driver.execute_script("return document.body.scrollHeight"))
    driver.set_window_size(width, min(max(height + 40, 600), 6000))
    driver.save_screenshot(str(path))
    return path


def console_errors(driver: Any) -> list[str]:
    """The browser console's errors since the last call (CSP violations and JS errors too)."""
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
