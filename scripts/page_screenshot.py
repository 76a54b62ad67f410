"""A screenshot of `vitkit serve`'s page after an upload, as a browser of 1200 x 900 shows it (headless
Chromium through selenium, the dev extra; Debian: apt-get install chromium chromium-driver).

    python scripts/page_screenshot.py runs/demo/best image.png docs/figures/serve-page.png

Runs `vitkit serve MODEL --port 0`, opens its page, chooses IMAGE, waits for the answer and saves OUT.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="what vitkit serve serves (a folder, a file, a hub name)")
    parser.add_argument("image", type=Path, help="the image to upload")
    parser.add_argument("out", type=Path, help="the screenshot to write (PNG)")
    parser.add_argument("--size", default="1200,900", help="browser window WIDTH,HEIGHT")
    args = parser.parse_args()
    os.environ.setdefault("SE_AVOID_STATS", "true")  # selenium-manager's usage reports
    server = subprocess.Popen([sys.executable, "-m", "vitkit.cli.main", "serve", args.model, "--port", "0"],
                              stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in server.stderr:
            sys.stderr.write(line)
            url = url or (m.group(1) if (m := re.search(r"at (http://[^ ]+/) ", line)) else None)
            if line.startswith("ready:"):
                break
        if url is None:
            sys.exit(f"vitkit serve {args.model} did not start")
        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium") or shutil.which("google-chrome") or ""
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                    f"--window-size={args.size}"):
            options.add_argument(arg)
        browser = webdriver.Chrome(options=options)
        try:
            browser.get(url)
            browser.find_element(By.ID, "file").send_keys(str(args.image.resolve()))
            WebDriverWait(browser, 60).until(
                lambda b: b.execute_script("return document.body.dataset.state") in ("done", "error"))
            time.sleep(0.3)  # the overlay's decode
            args.out.parent.mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(str(args.out))
            print(f"wrote {args.out} ({browser.execute_script('return document.body.dataset.state')})")
        finally:
            browser.quit()
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
