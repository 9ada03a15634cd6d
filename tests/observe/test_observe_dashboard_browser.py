"""The coordinator's dashboard in a real headless browser (Debian's chromium and chromium-driver, driven by
selenium): the page shows a running job and its ranks, updates itself, names a straggler, plots the job's pace and
links its merged timeline, and logs no error in the console.

Skips where selenium, chromium or chromedriver are missing (`apt-get install chromium chromium-driver`,
`pip install selenium`). With AXOND_TEST_SCREENSHOTS=DIR it also saves its screenshots there.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from axond.coordinator.server import RunningCoordinator
from dashboard_job import TOKEN, start_dashboard_job
from worker_support import FAST, Procs, procs  # noqa: F401

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="no chromium and chromedriver (apt-get install chromium chromium-driver)")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1200,1000",
                f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: Any, predicate: Callable[[Any], Any], timeout: float, what: str) -> None:
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:  # the page redraws its tables on every refresh: an element found a moment ago may be gone; look again
        WebDriverWait(driver, timeout, poll_frequency=0.2,
                      ignored_exceptions=(StaleElementReferenceException,)).until(predicate)
    except TimeoutException:
        pytest.fail(f"timed out after {timeout} s waiting for {what}; the page says:\n"
                    f"{driver.find_element('tag name', 'body').text}")


def _screenshot(driver: Any, name: str, tmp_path: Path) -> None:
    driver.save_screenshot(str(tmp_path / name))
    where = os.environ.get("AXOND_TEST_SCREENSHOTS")
    if where:
        driver.save_screenshot(str(Path(where) / name))


def test_the_dashboard_shows_a_running_job_and_updates(coordinator_factory: Callable[..., RunningCoordinator],
                                                       procs: Procs, tmp_path: Path, browser: Any) -> None:
    shown = start_dashboard_job(coordinator_factory, procs, tmp_path)
    browser.get(shown.url + f"?token={TOKEN}")
    _wait(browser, lambda d: d.find_elements("css selector", ".job[data-job='shown'] .state-running"), 30,
          "the running job on the page")
    updates = int(browser.find_element("tag name", "body").get_attribute("data-updates"))
    _wait(browser, lambda d: int(d.find_element("tag name", "body").get_attribute("data-updates")) >= updates + 2, 30,
          "two more refreshes")
    _wait(browser, lambda d: "all_reduce on group 'world'" in d.find_element("css selector", ".ranks").text, 60,
          "rank 0's all_reduce in the ranks table (reports start after 7.5 s of the ranks' 30 s timeout)")
    text = browser.find_element("tag name", "body").text
    assert "shown" in text and "productive" in text and "goodput" in text
    def one_node_row(d: Any) -> bool:
        rows = [row.text for row in d.find_elements("css selector", "#nodes tbody tr")]
        return len(rows) == 1 and "shown" in rows[0]

    _wait(browser, one_node_row, 10, "one node row naming the job")
    _screenshot(browser, "culprit-dashboard.png", tmp_path)
    errors = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
    assert errors == [], errors


def test_the_dashboard_refuses_a_browser_without_the_token(coordinator_factory: Callable[..., RunningCoordinator],
                                                           procs: Procs, tmp_path: Path, browser: Any) -> None:
    shown = start_dashboard_job(coordinator_factory, procs, tmp_path, job="refused")
    browser.get(shown.url)
    assert "requires its token" in browser.find_element("tag name", "body").text
    assert not browser.find_elements("css selector", ".job")


@pytest.mark.slow  # four ranks training until the straggler is named
@pytest.mark.timeout(150)
def test_the_dashboard_shows_a_straggler_and_the_jobs_pace(coordinator_factory: Callable[..., RunningCoordinator],
                                                           procs: Procs, tmp_path: Path, browser: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXOND_TIMELINE", str(tmp_path / "timeline"))  # the ranks'
    coord = coordinator_factory(**FAST, metrics_port=0, token=TOKEN, timeline_dir=str(tmp_path / "timeline"))
    assert coord.metrics is not None
    env = {"SLOW_RANK": "1", "SLOW_S": "0.2", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    procs.axond("worker", "--coordinator", coord.address, "--token", TOKEN, "--job", "slow", "--nproc-per-node", "4",
                "--", sys.executable, "-m", "axond.testing.straggler_job", "400", env=env)
    browser.get(f"http://127.0.0.1:{coord.metrics.port}/?token={TOKEN}")

    def straggler_row(d: Any) -> bool:
        rows = [r.text for r in d.find_elements("css selector", ".job[data-job='slow'] .ranks tr")]
        return any(r.startswith("1 ") and "yes: others wait" in r for r in rows)

    _wait(browser, straggler_row, 90, "rank 1 named a straggler in the ranks table")
    _wait(browser, lambda d: d.find_elements("css selector", ".job[data-job='slow'] .pace-plot polyline"), 10,
          "the job's pace plot")
    assert "ms per step (rank 0)" in browser.find_element("css selector", ".pace-plot").text  # axond.mark_step()
    rows = [r.text for r in browser.find_elements("css selector", ".job[data-job='slow'] .ranks tr")]
    assert sum("yes: others wait" in r for r in rows) == 1, rows
    updates = int(browser.find_element("tag name", "body").get_attribute("data-updates"))
    _wait(browser, lambda d: int(d.find_element("tag name", "body").get_attribute("data-updates")) >= updates + 2, 30,
          "two more refreshes (the goodput counts the ranks as running from the read that saw their marks)")
    _screenshot(browser, "culprit-straggler.png", tmp_path)
    link = browser.find_element("css selector", ".job[data-job='slow'] a.timeline").get_attribute("href")
    with urllib.request.urlopen(link, timeout=30) as answer:
        trace = json.loads(answer.read())
    files = {r["file"] for r in trace["otherData"]["axond"]["ranks"]}
    assert len(files) == 4 and all(f.startswith("rank-") for f in files), files
    assert any(e.get("ph") == "X" for e in trace["traceEvents"]), "the ranks' collectives, merged"
    errors = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
    assert errors == [], errors
