"""Debian's headless Chromium, driven by selenium, for the tests that look at pages
(tests/test_browser.py, tests/test_docs.py): never a downloaded browser or driver."""

import importlib.util
import os

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WIDTH, HEIGHT = 1280, 1024


def require_browser():
  missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
  if importlib.util.find_spec("selenium") is None:
    missing.append("the selenium package")
  if not missing:
    return
  what = " and ".join(missing)
  if os.environ.get("CI") == "true":
    pytest.fail(
      f"CI=true, but missing {what}: .ci/run should have installed Debian's "
      "chromium and chromium-driver (apt-get) and selenium (the dev extra).",
      pytrace=False,
    )
  pytest.skip(
    f"real-browser test, missing {what} (Debian: apt-get install chromium "
    "chromium-driver; selenium comes with pip install -e '.[dev]')"
  )


def start_browser(javascript: bool = True):
  require_browser()
  from selenium import webdriver
  from selenium.webdriver.chrome.service import Service

  options = webdriver.ChromeOptions()
  if not javascript:
    options.add_experimental_option(
      "prefs", {"profile.managed_default_content_settings.javascript": 2}
    )
  options.binary_location = CHROMIUM
  for arg in (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    f"--window-size={WIDTH},{HEIGHT}",
    "--force-device-scale-factor=1",
  ):
    options.add_argument(arg)
  with pytest.MonkeyPatch.context() as env:
    # Debian's browser and driver or nothing: Selenium Manager must never download one,
    # and SE_CHROMEDRIVER would override the Service's path.
    env.setenv("SE_OFFLINE", "true")
    env.delenv("SE_CHROMEDRIVER", raising=False)
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
