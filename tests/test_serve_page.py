"""vitkit serve's page in a real headless Chromium (selenium, driving the system's chromium and chromedriver):
upload an image, read the top-5 from the page, see the attention overlay, save a screenshot."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("starlette", reason="vitkit serve needs the serve extra: pip install 'vitkit[serve]'")
pytest.importorskip("selenium", reason="the page test drives Chromium with selenium (the dev extra)")

import httpx  # noqa: E402
from PIL import Image  # noqa: E402
from selenium import webdriver  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

import vitkit  # noqa: E402
from serve_helpers import PHOTOS, running_server, tiny_model  # noqa: E402
from vitkit.serve import ModelWorker  # noqa: E402

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def chromium_driver() -> webdriver.Chrome:
    """A headless Chromium through the system's chromedriver; skips, saying why, where there is none."""
    driver_path = shutil.which("chromedriver")
    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if driver_path is None or browser is None:
        pytest.skip("no browser to drive: install chromium and chromium-driver (Debian: apt-get install "
                    f"chromium chromium-driver); found chromedriver={driver_path}, chromium={browser}")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,900"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))


@pytest.fixture(scope="module")
def page():
    """The page of a real server, open in Chromium: (driver, server URL)."""
    model = tiny_model()
    browser = chromium_driver()
    try:
        with running_server(ModelWorker(vitkit.optimize(model), "tiny")) as url:
            browser.get(url + "/")
            yield browser, url
    finally:
        browser.quit()


def upload(browser, path) -> str:
    """Choose `path` in the page's file input and wait for the page to finish; returns its state."""
    browser.execute_script("document.body.dataset.state = ''")
    browser.find_element(By.ID, "file").send_keys(str(path))
    WebDriverWait(browser, 30).until(lambda b: b.execute_script("return document.body.dataset.state") in
                                     ("done", "error"))
    state = browser.execute_script("return document.body.dataset.state")
    if state == "error":  # the page's own message, in the test's report
        print("the page says:", browser.find_element(By.ID, "status").text)
    return state


def test_the_page_shows_the_top_5_and_the_overlay(page, tmp_path):
    browser, url = page
    assert browser.title == "vitkit serve: tiny"
    photo = PHOTOS / "china.jpg"
    assert upload(browser, photo) == "done"
    rows = browser.find_elements(By.CSS_SELECTOR, "#predictions li")
    shown = [(r.find_element(By.CLASS_NAME, "label").text, r.find_element(By.CLASS_NAME, "score").text)
             for r in rows]
    expected = httpx.post(f"{url}/predictions?top_k=5", content=photo.read_bytes()).json()
    assert shown == [(p["label"], f"{100 * p['score']:.1f} %") for p in expected]
    width = browser.execute_script("return document.getElementById('overlay').naturalWidth")
    assert width == 224  # the overlay PNG arrived and decoded
    assert "china.jpg" in browser.find_element(By.ID, "status").text
    # at 1200 x 900 the top-5 and both images are in view without scrolling
    bottoms = browser.execute_script(
        "return ['result', 'original', 'overlay'].map(id => document.getElementById(id)"
        ".getBoundingClientRect().bottom).concat([window.innerHeight])")
    assert max(bottoms[:3]) <= bottoms[3], bottoms
    shot = tmp_path / "serve-page.png"
    assert browser.save_screenshot(str(shot))
    assert Image.open(shot).size[0] > 0
    if os.environ.get("VITKIT_SERVE_SCREENSHOT"):  # keep a copy, e.g. for the docs
        shutil.copy(shot, os.environ["VITKIT_SERVE_SCREENSHOT"])


def test_the_page_shows_the_servers_error(page, tmp_path):
    browser, _ = page
    text = tmp_path / "notes.png"  # an image's name, not an image's bytes
    text.write_text("these are notes, not pixels")
    assert upload(browser, text) == "error"
    assert "not an image file" in browser.find_element(By.ID, "status").text
    assert browser.find_elements(By.CSS_SELECTOR, "#predictions li") == []
    # no broken-image icon beside the error: both panels are empty
    sources = browser.execute_script(
        "return ['original', 'overlay'].map(id => document.getElementById(id).getAttribute('src'))")
    assert sources == [None, None]
    assert browser.execute_script("return getComputedStyle(document.getElementById('original')).visibility") \
        == "hidden"
    icon = browser.execute_script(
        "return fetch('/favicon.ico').then(r => [r.status, r.headers.get('content-type')])")
    assert icon == [200, "image/x-icon"]
    shot = tmp_path / "serve-page-error.png"
    assert browser.save_screenshot(str(shot))
    if os.environ.get("VITKIT_SERVE_SCREENSHOT"):
        shutil.copy(shot, os.environ["VITKIT_SERVE_SCREENSHOT"].replace(".png", "-error.png"))
