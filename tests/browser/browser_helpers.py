"""Finding the system Chromium and chromedriver (a test tool's own browser download is not used)."""

import os
import shutil


def chromium_paths() -> tuple[str | None, str | None]:
    """(browser, driver) from TURBO_MOE_CHROMIUM / TURBO_MOE_CHROMEDRIVER or PATH; None where absent."""
    browser = os.environ.get("TURBO_MOE_CHROMIUM") or next(
        filter(None, (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = os.environ.get("TURBO_MOE_CHROMEDRIVER") or shutil.which("chromedriver")
    return browser, driver
