"""Open rendered chapters in headless Chromium and check what a reader sees.

For each page: the math was typeset by MathJax (every math element holds an `mjx-container`, no MathJax
error), code cells and their outputs are there, and no nbdev directive (`#|`) is visible.
Usage: python tests/check_rendered_book.py [--chromium PATH] [--screenshot PNG] PAGE.html [...]
"""
import argparse, subprocess, sys, tempfile
from pathlib import Path

from bs4 import BeautifulSoup

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def chromium(binary: str, url: str, *extra: str) -> str:
    "Run headless Chromium on `url`, letting scripts (MathJax) run, and return what it prints."
    with tempfile.TemporaryDirectory() as profile:
        cmd = [binary, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=20000", *extra, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=True).stdout


def problems(dom: str) -> list:
    "What is wrong with one rendered chapter, as readable sentences (empty when all is well)."
    soup, found = BeautifulSoup(dom, "html.parser"), []
    maths = soup.select(".math")
    if not maths: found.append("no math on the page")
    untypeset = [m for m in maths if m.find("mjx-container") is None]
    if untypeset: found.append(f"{len(untypeset)} of {len(maths)} math elements were not typeset, e.g. {untypeset[0].get_text()[:60]!r}")
    if soup.find("mjx-merror"): found.append(f"MathJax error: {soup.find('mjx-merror').get_text()[:80]!r}")
    if not soup.select("div.cell div.cell_input"): found.append("no code cells")
    if not soup.select("div.cell div.cell_output"): found.append("no cell outputs")
    text = soup.select_one("main").get_text() if soup.select_one("main") else soup.get_text()
    if "#|" in text: found.append("an nbdev directive '#|' is visible: " + text[text.index("#|"):][:60].replace("\n", " "))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("pages", nargs="+", type=Path)
    ap.add_argument("--chromium", default="chromium")
    ap.add_argument("--screenshot", type=Path, help="also save a screenshot of the first page")
    args = ap.parse_args()
    failed = False
    for page in args.pages:
        url = page.resolve().as_uri()
        found = problems(chromium(args.chromium, url, "--dump-dom"))
        print(f"{page}: {'OK' if not found else 'FAILED'}")
        for p in found: print(f"  - {p}")
        failed |= bool(found)
    if args.screenshot:
        chromium(args.chromium, args.pages[0].resolve().as_uri(), f"--screenshot={args.screenshot.resolve()}", "--window-size=1280,2400")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
