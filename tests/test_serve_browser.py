"""The web page in real headless Chromium (Debian's /usr/bin/chromium driven by Playwright).

Sends a chat message and waits for the streamed answer to appear token by token, then runs the
compare view on two served models; screenshots of both views go to out/screenshots/.
"""
from __future__ import annotations

import os
import shutil
import time

import pytest

import serve_fixtures as F

CHROMIUM = os.environ.get("TRAPETUM_CHROMIUM", "/usr/bin/chromium")
KEY = "sk-browser-test"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]

sync_api = pytest.importorskip("playwright.sync_api", reason="needs `pip install playwright`")
if not shutil.which(CHROMIUM) and not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (scripts/install.sh --test installs it with apt-get, which needs root; "
                "or set TRAPETUM_CHROMIUM to a Chromium binary)", allow_module_level=True)


@pytest.fixture(scope="module")
def server():
    # Two names for the embedded model, so the compare view has two columns to fill.
    srv = F.start_serve(["smollm2=default", "smollm2-copy=default", "--queue", "8", "--threads", "1",
                         "--api-key", KEY])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def page():
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        pg = browser.new_page(viewport={"width": 1280, "height": 800})
        yield pg
        browser.close()


def test_chat_streams_and_compare(server, page):
    F.SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    page.wait_for_selector("#health.ok", timeout=10_000)
    page.wait_for_function("document.querySelector('#chat-info').textContent.includes('401')")
    page.click("#key-btn")                                   # the server wants a key: enter it
    page.fill("#key-input", KEY)
    page.click("#key-ok")
    page.wait_for_function("document.querySelector('#chat-model').options.length === 2")
    page.wait_for_selector("#health.ok", timeout=10_000)
    assert "parameters" in page.inner_text("#chat-info")      # model info shown

    page.fill("#set-temp", "0")
    page.fill("#set-max", "48")
    page.fill("#chat-input", "What is the capital of France? Answer in one sentence.")
    page.click("#chat-send")
    # Streaming: the answer bubble is visibly growing while it still has the streaming cursor.
    page.wait_for_function("""() => { const m = document.querySelector('.msg.assistant.streaming .body');
                                      return m && m.textContent.length > 0; }""", timeout=60_000)
    partial = page.inner_text(".msg.assistant .body")
    page.screenshot(path=str(F.SCREENSHOTS / "chat-streaming.png"))       # mid-answer, cursor showing
    page.wait_for_selector(".msg.assistant .meta", timeout=60_000)      # finished
    final = page.inner_text(".msg.assistant .body")
    assert final.strip(), "no answer text"
    assert final.startswith(partial) and len(final) >= len(partial)
    assert "error" not in page.get_attribute(".msg.assistant", "class")
    assert page.inner_text("#chat-tps") not in ("", "–")
    assert page.inner_text("#chat-ttft") not in ("", "–")
    meta = page.inner_text(".msg.assistant .meta")
    assert "tok/s" in meta and "TTFT" in meta
    chat_png = F.SCREENSHOTS / "chat.png"
    page.screenshot(path=str(chat_png))

    page.click("#tab-compare")
    assert page.input_value("#cmp-a .cmp-model") == "smollm2"
    assert page.input_value("#cmp-b .cmp-model") == "smollm2-copy"
    page.fill("#cmp-input", "Name three colors.")
    page.click("#cmp-send")
    page.wait_for_function("""() => [...document.querySelectorAll('.cmp-col .state')]
                                     .every(s => s.textContent.startsWith('done'))""", timeout=90_000)
    for col in ("#cmp-a", "#cmp-b"):
        assert page.inner_text(f"{col} .out").strip()
        assert page.inner_text(f"{col} .tps") not in ("", "–")
        assert page.inner_text(f"{col} .ttft") not in ("", "–")
        assert "params" in page.inner_text(f"{col} .cmp-info")
    # Greedy on the same weights: the two columns must agree.
    assert page.inner_text("#cmp-a .out") == page.inner_text("#cmp-b .out")
    page.wait_for_selector("#health.ok", timeout=10_000)
    cmp_png = F.SCREENSHOTS / "compare.png"
    page.screenshot(path=str(cmp_png))

    # Stop mid-answer: the page aborts the fetch, the server cancels the generation.
    page.click("#tab-chat")
    page.fill("#set-max", "400")
    page.fill("#chat-input", "Write a long story about a dragon who learns to cook.")
    page.click("#chat-send")
    page.wait_for_function("""() => { const m = document.querySelectorAll('.msg.assistant.streaming .body');
                                      return m.length && m[m.length - 1].textContent.length > 20; }""",
                           timeout=60_000)
    page.click("#chat-stop")
    page.wait_for_function("""() => { const m = document.querySelectorAll('.msg.assistant .meta');
                                      return m.length === 2 && m[1].textContent.includes('stopped'); }""",
                           timeout=5_000)
    t0 = time.time()
    while server.health()[1]["engines"][0]["running"] and time.time() - t0 < 3:
        time.sleep(0.05)
    assert server.health()[1]["engines"][0]["running"] == 0, "generation still running after Stop"
    assert not errors, errors
    print(f"\nscreenshots: {chat_png} {cmp_png}")


@pytest.mark.skipif(not os.environ.get("TRAPETUM_DEMO_CBK"), reason="set TRAPETUM_DEMO_CBK to a .cbk of the "
                    "embedded model (trapetum quantize) for the source-vs-4-bit compare screenshot")
def test_compare_source_and_cbk(page):
    """The seed's live compare demo: the GGUF source and its 4-bit .cbk on one prompt."""
    srv = F.start_serve(["source=default", f"4bit={os.environ['TRAPETUM_DEMO_CBK']}", "--threads", "1"])
    try:
        page.goto(srv.url + "/")
        page.wait_for_function("document.querySelector('#cmp-b .cmp-model').options.length === 2")
        page.fill("#set-temp", "0")
        page.fill("#set-max", "24")
        page.click("#tab-compare")
        page.fill("#cmp-input", "What is the capital of France?")
        page.click("#cmp-send")
        page.wait_for_function("""() => [...document.querySelectorAll('.cmp-col .state')]
                                         .every(s => s.textContent.startsWith('done'))""", timeout=300_000)
        assert "cbk" in page.inner_text("#cmp-b .cmp-info")
        page.wait_for_selector("#health.ok", timeout=10_000)
        png = F.SCREENSHOTS / "compare-source-vs-4bit.png"
        page.screenshot(path=str(png))
        page.click("#tab-chat")
        page.select_option("#chat-model", "4bit")
        page.screenshot(path=str(F.SCREENSHOTS / "model-info-4bit.png"))
        print(f"\nscreenshot: {png}")
    finally:
        srv.stop()
