"""Headless Chromium drives the page: send a message, watch the highlighted reply and the figures, toggle plain
text, Stop, and save a screenshot (to $EAGLE_SCREENSHOT, e.g. assets/screenshot.png for the README's picture;
else to the temp folder, so a test run never rewrites a tracked file).

Needs Debian's `chromium` and `chromium-driver` (apt-get install -y chromium chromium-driver) and the Python
package `selenium`; skipped with the reason when one is missing. The page runs on a tiny random model, or on
the embedded default (SmolLM2-135M-Instruct + assets/smollm2-eagle3) when both are already on this machine,
which gives a screenshot with real text.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time

import pytest
from app_fixtures import ScriptedEngine, one_thread, serve, tiny_engine

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SCREENSHOT = os.environ.get("EAGLE_SCREENSHOT") or os.path.join(tempfile.gettempdir(), "eagle-app.png")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1000", "--force-device-scale-factor=1"]  # fmt: skip

pytestmark = [
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} absent: apt-get install -y chromium"),
    pytest.mark.skipif(not os.path.exists(DRIVER), reason=f"{DRIVER} absent: apt-get install -y chromium-driver"),
    pytest.mark.filterwarnings("ignore:.*no_silent_downcasting", "ignore:The copy keyword"),
]
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed: pip install selenium")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402


def default_engine():
    """The embedded default model, only if it is already here (no download, no conversion)."""
    from eagle.chat.model_types import DEFAULT_HEAD_DIR

    try:
        from eagle.default_model import MARKER, converted_model_dir
    except ImportError:
        return None
    base = converted_model_dir()
    if not (base / MARKER).is_file() or not (DEFAULT_HEAD_DIR / "config.json").is_file():
        return None
    import torch

    from app.engine import Engine
    from eagle.model.ea_model import EaModel

    # a small tree: on a CPU the draft's big-vocabulary steps dominate a round
    model = EaModel.from_pretrained(str(base), str(DEFAULT_HEAD_DIR), total_token=12, depth=3, top_k=4,
                                    dtype=torch.float32)  # fmt: skip
    return Engine(model, "chat-template", 2048, name="smollm2: SmolLM2-135M-Instruct + EAGLE-3 head",
                  info={"model_type": "smollm2", "draft": "EAGLE-3"})  # fmt: skip


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    with one_thread():
        engine = default_engine()
        real = engine is not None
        engine = engine or tiny_engine(str(tmp_path_factory.mktemp("app_browser")), max_length=512)
        with serve(engine, max_new_tokens=48) as demo:
            options = webdriver.ChromeOptions()
            options.binary_location = CHROMIUM
            profile = tempfile.mkdtemp(prefix="chromium-profile-")
            for flag in [*FLAGS, f"--user-data-dir={profile}"]:
                options.add_argument(flag)
            driver = webdriver.Chrome(service=webdriver.ChromeService(DRIVER), options=options)
            try:
                driver.get(demo.local_url)
                yield driver, real
            finally:
                driver.quit()
                shutil.rmtree(profile, ignore_errors=True)


def wait_for(driver, script: str, timeout: float = 60.0):
    """Poll a JavaScript expression until it is truthy; return its value."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = driver.execute_script(f"return ({script});")
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for: {script}\nthe page then: {driver.execute_script(PAGE_STATE)}")


PAGE_STATE = """return {
  figures: (document.querySelector('#figures') || {}).innerText,
  messages: [...document.querySelectorAll('#chat .message')].map(m => m.innerText.slice(0, 300)),
  toasts: [...document.querySelectorAll('.toast-body')].map(t => t.innerText),
  box: (document.querySelector('#msg textarea') || {}).value,
};"""  # what a failed wait saw: a CI log then says which part of the page was behind


BOT = "document.querySelectorAll('#chat .message.bot .eagle-tokens, #chat .bot .eagle-tokens')"
FIGURES = "document.querySelector('#figures').innerText"


def send(driver, text: str):
    box = driver.find_element(By.CSS_SELECTOR, "#msg textarea")
    box.click()
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def test_chat_in_a_real_browser(page):
    driver, real = page
    wait_for(driver, "document.querySelector('#msg textarea')")
    assert "drafted by EAGLE" in driver.find_element(By.TAG_NAME, "body").text  # the legend

    send(driver, "Write a haiku about eagles." if real else "w7 w8 w9")
    wait_for(driver, f"{BOT}.length == 1", 120)
    wait_for(driver, f"{FIGURES}.includes('tokens/s') && !{FIGURES}.includes('generating')", 180)
    figures = driver.execute_script(f"return {FIGURES};")
    assert "mean accepted tokens / base forward" in figures and "rounds" in figures

    # the highlight survives the chat's sanitiser and gets its CSS from launch(css=...)
    n_acc = driver.execute_script("return document.querySelectorAll('#chat .eagle-tokens .acc').length;")
    if not real:
        assert n_acc > 0
    if n_acc:
        bg = driver.execute_script(
            "return getComputedStyle(document.querySelector('#chat .eagle-tokens .acc')).backgroundColor;"
        )
        assert bg not in ("", "rgba(0, 0, 0, 0)", "transparent")
    assert driver.execute_script("return document.querySelectorAll('#chat .eagle-tokens script, #chat .eagle-tokens style').length;") == 0
    time.sleep(0.5)
    os.makedirs(os.path.dirname(os.path.abspath(SCREENSHOT)), exist_ok=True)
    driver.save_screenshot(SCREENSHOT)

    # plain-text toggle: the same rendered reply without highlight spans, then back
    acc = "document.querySelectorAll('#chat .eagle-tokens .acc').length"
    toggle = driver.find_element(By.CSS_SELECTOR, "#highlight input")
    toggle.click()
    wait_for(driver, f"{BOT}.length == 1 && {acc} == 0", 30)
    toggle.click()
    wait_for(driver, f"{BOT}.length == 1 && {acc} == {n_acc}", 30)


def set_number(driver, elem_id: str, value):
    box = driver.find_element(By.CSS_SELECTOR, f"#{elem_id} input[type=number]")
    box.clear()
    box.send_keys(str(value))
    box.send_keys(Keys.TAB)


def test_typed_html_shows_as_text_and_loads_nothing(page):
    driver, _ = page
    driver.find_element(By.ID, "clear").click()
    typed = "<img src=x onerror=alert(1)> and <b>bold?</b>"
    send(driver, typed)
    user = "document.querySelector('#chat .message.user, #chat .user')"
    wait_for(driver, f"{user} && {user}.innerText.includes('onerror')", 60)
    assert typed in driver.execute_script(f"return {user}.innerText;")
    assert driver.execute_script(f"return {user}.querySelectorAll('img, b').length;") == 0
    requested = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name);")
    assert not [u for u in requested if u.rstrip("/").endswith("/x")]
    wait_for(driver, f"{FIGURES}.includes('tokens/s') && !{FIGURES}.includes('generating')", 180)


def test_an_empty_message_shows_a_notice_and_keeps_the_chat(page):
    driver, _ = page
    wait_for(driver, "document.querySelector('#msg textarea')")
    users = "document.querySelectorAll('#chat .message.user, #chat .user').length"
    before = driver.execute_script(f"return {users};")
    send(driver, "   ")
    wait_for(driver, "document.body.innerText.includes('Type a message first')", 30)  # a toast
    time.sleep(0.5)
    assert driver.execute_script(f"return {users};") == before  # nothing was added to the conversation


def test_an_overlong_message_is_refused_at_once_and_stays_in_the_box(page):
    driver, _ = page
    wait_for(driver, "document.querySelector('#msg textarea')")
    driver.find_element(By.ID, "clear").click()
    box = driver.find_element(By.CSS_SELECTOR, "#msg textarea")
    # 100k characters typed at once (send_keys would take minutes): set the value as an input event would
    set_value = ("const t = arguments[0]; Object.getOwnPropertyDescriptor(HTMLTextAreaElement.prototype, 'value')"
                 ".set.call(t, arguments[1]); t.dispatchEvent(new Event('input', {bubbles: true}));")  # fmt: skip
    driver.execute_script(set_value, box, "w9 " * 34_000)
    time.sleep(0.5)
    box.send_keys(Keys.ENTER)
    toasts = "Array.from(document.querySelectorAll('.toast-body')).filter(t => t.innerText.includes('shorten it'))"
    wait_for(driver, f"{toasts}.length >= 1", 30)
    time.sleep(1.5)
    assert driver.execute_script(f"return {toasts}.length;") == 1
    assert "context holds" in driver.execute_script(f"return {toasts}[0].innerText;")  # names the limit
    assert len(box.get_property("value")) == 102_000  # kept, to be shortened
    assert driver.execute_script("return document.querySelectorAll('#chat .message.user, #chat .user').length") == 0
    driver.execute_script(set_value, box, "")
    driver.execute_script("document.querySelectorAll('.toast-close').forEach(b => b.click());")
    wait_for(driver, "document.querySelectorAll('.toast-body').length == 0", 30)  # they cover the settings


def test_stop_then_send_again_in_the_browser(page):
    driver, real = page
    driver.find_element(By.ID, "clear").click()
    wait_for(driver, f"{BOT}.length == 0 && {FIGURES}.includes('No reply yet')", 30)
    stop_live = "!document.querySelector('#stop').disabled"
    wait_for(driver, f"!({stop_live})", 30)  # nothing runs: Stop is greyed out
    set_number(driver, "max_new", 4000)  # capped by the context: a long reply, to be stopped
    driver.find_element(By.CSS_SELECTOR, "#eagle input").click()  # vanilla: one token per round
    time.sleep(0.3)
    send(driver, "Tell me a very long story." if real else "w36 w37 w38")
    wait_for(driver, f"{FIGURES}.includes('generating') && {stop_live}", 60)
    driver.find_element(By.ID, "stop").click()
    wait_for(driver, f"{FIGURES}.includes('stopped by you')", 30)
    stopped = driver.execute_script("return document.querySelectorAll('#chat .message-row, #chat .message').length")
    assert stopped >= 2  # the question and the partial reply stay
    driver.find_element(By.CSS_SELECTOR, "#eagle input").click()
    set_number(driver, "max_new", 16)
    time.sleep(0.3)
    send(driver, "Thanks!" if real else "w32")
    # the stopped reply stays (one of the two), and its figures say "Vanilla (EAGLE off)" until this one's come
    wait_for(driver, f"{BOT}.length == 2 && {FIGURES}.includes('EAGLE') && !{FIGURES}.includes('EAGLE off') "
                     f"&& !{FIGURES}.includes('generating')", 120)  # fmt: skip
    wait_for(driver, f"!({stop_live})", 30)  # the reply is done: greyed out again
    assert "Error" not in driver.find_element(By.TAG_NAME, "body").text
    driver.save_screenshot(os.path.join(tempfile.gettempdir(), "eagle-app-after-stop.png"))  # for a look by eye


def test_a_message_sent_while_a_reply_runs_is_answered_after_it(page):
    driver, real = page
    wait_for(driver, "document.querySelector('#msg textarea')")
    driver.find_element(By.ID, "clear").click()
    wait_for(driver, f"{BOT}.length == 0 && {FIGURES}.includes('No reply yet')", 30)
    set_number(driver, "max_new", 32 if real else 400)  # long enough to send the second message meanwhile
    send(driver, "Name three birds." if real else "w7 w8 w9")
    wait_for(driver, f"{FIGURES}.includes('generating')", 60)
    second = "And three fish?" if real else "w10 w11"
    send(driver, second)  # through the same event as the first, still running
    wait_for(driver, f"{BOT}.length == 2 && !{FIGURES}.includes('generating')", 180)
    shown = driver.execute_script("return [...document.querySelectorAll('#chat .message')].map(m => m.innerText);")
    assert second in shown and shown[-1] != second  # the second message, then its reply
    assert "Error" not in driver.find_element(By.TAG_NAME, "body").text
    set_number(driver, "max_new", 16)


def test_a_reload_keeps_the_conversation_and_its_figures(page):
    driver, real = page
    wait_for(driver, "document.querySelector('#msg textarea')")
    wait_for(driver, f"!{FIGURES}.includes('generating')", 180)  # nothing runs
    driver.find_element(By.ID, "clear").click()
    wait_for(driver, f"{BOT}.length == 0 && {FIGURES}.includes('No reply yet')", 30)
    stored = "(localStorage.getItem('eagle-chat') || '').length"  # encrypted: its length tells empty from not
    wait_for(driver, f"{stored} > 0 && {stored} < 200", 30)  # Clear saved an empty conversation
    send(driver, "Name three birds." if real else "w7 w8 w9")
    wait_for(driver, f"{BOT}.length == 1 && {FIGURES}.includes('tokens/s') && !{FIGURES}.includes('generating')", 180)
    wait_for(driver, f"{stored} > 200", 30)  # saved once the reply is done
    shown = "[...document.querySelectorAll('#chat .message')].map(m => m.innerText)"
    chat, figures = driver.execute_script(f"return [{shown}, {FIGURES}];")
    acc = driver.execute_script("return document.querySelectorAll('#chat .eagle-tokens .acc').length;")

    driver.refresh()
    wait_for(driver, f"{BOT}.length == 1", 60)
    wait_for(driver, f"{FIGURES}.includes('tokens/s')", 30)
    assert driver.execute_script(f"return [{shown}, {FIGURES}];") == [chat, figures]
    assert driver.execute_script("return document.querySelectorAll('#chat .eagle-tokens .acc').length;") == acc

    send(driver, "Thanks!" if real else "w32")  # and the conversation goes on from there
    wait_for(driver, f"{BOT}.length == 2 && !{FIGURES}.includes('generating')", 180)


# markdown replies: a scripted engine (no model) answers with known rounds ---------------------------------
MARKDOWN_ROUNDS = [  # in each round every piece but the last was drafted by EAGLE and accepted
    ["1.", " **", "Fast", " path", "**"], [":", " drafts", " are", " checked"], ["\n2.", " **", "Safe"],
    ["**", ":", " <img src=x onerror=alert(1)>", " <script>alert(2)</script>", " done"], ["\n\n", "End."],
]  # fmt: skip


@pytest.fixture
def markdown_page(page):
    """The page's browser on a second server, whose engine answers with MARKDOWN_ROUNDS; back home after."""
    driver, _ = page
    home = driver.current_url
    with serve(ScriptedEngine(MARKDOWN_ROUNDS)) as demo:
        driver.get(demo.local_url)
        try:
            yield driver
        finally:
            driver.get(home)


def test_markdown_reply_renders_bold_titles_with_highlights_and_no_injected_elements(markdown_page):
    driver = markdown_page
    wait_for(driver, "document.querySelector('#msg textarea')")
    send(driver, "Give me a list.")
    reply = "document.querySelector('#chat .bot .eagle-tokens')"
    wait_for(driver, f"{reply} && {reply}.innerText.includes('End.') && !{FIGURES}.includes('generating')", 60)
    titles = driver.execute_script(f"return [...{reply}.querySelectorAll('ol > li > strong')].map(s => s.innerHTML);")
    assert titles == ['<span class="acc">Fast path</span>', "Safe"]  # "Safe" came from the base model

    shown = driver.execute_script(f"return {reply}.innerText;")
    assert "**" not in shown and "<img src=x onerror=alert(1)>" in shown and "<script>alert(2)</script>" in shown
    assert driver.execute_script("return document.querySelectorAll('#chat .bot img, #chat .bot script').length;") == 0
    requested = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name);")
    assert not [u for u in requested if u.rstrip("/").endswith("/x")]

    # the message's accessible label is its text, not its HTML
    label = driver.execute_script("return document.querySelector(\"#chat [aria-label^=\\\"bot's message\\\"]\")"
                                  ".getAttribute('aria-label');")  # fmt: skip
    assert label.startswith("bot's message: Fast path: drafts are checked") and "<span" not in label


class RecordingEngine(ScriptedEngine):
    """A scripted engine that notes the message each run answers."""

    def __init__(self, rounds):
        super().__init__(rounds)
        self.asked = []

    def fit(self, turns, system, max_new_tokens):
        self.asked.append(turns[-1][0])
        return super().fit(turns, system, max_new_tokens)


def test_run_both_clicked_while_a_comparison_runs_runs_the_new_prompt_after_it(page):
    driver, _ = page
    home = driver.current_url
    engine = RecordingEngine([[f" w{i}", f" x{i}"] for i in range(24)])  # vanilla 2.4 s, EAGLE 1.2 s (48 tokens)
    with serve(engine, max_new_tokens=48) as demo:
        driver.get(demo.local_url)
        try:
            wait_for(driver, "document.querySelector('#msg textarea')")
            driver.find_element(By.XPATH, "//button[@role='tab'][contains(., 'EAGLE vs vanilla')]").click()
            box = driver.find_element(By.CSS_SELECTOR, "#cmp_msg textarea")
            wait_for(driver, "document.querySelector('#cmp_msg textarea').offsetParent !== null", 30)
            box.send_keys("Name three birds.")
            driver.find_element(By.ID, "cmp_run").click()
            stop_live = "!document.querySelector('#cmp_stop').disabled"
            wait_for(driver, stop_live, 30)
            box.send_keys(Keys.CONTROL, "a")
            box.send_keys("And three fish?")
            driver.find_element(By.ID, "cmp_run").click()  # through the same event as the first, still running
            deadline = time.time() + 60
            while "And three fish?" not in engine.asked and time.time() < deadline:
                time.sleep(0.05)
            assert "And three fish?" in engine.asked, engine.asked  # the second click got a run
            time.sleep(0.5)  # the first run's end has reached the page
            assert driver.execute_script(f"return {stop_live};")  # the second run can be stopped
            wait_for(driver, f"!({stop_live}) && document.querySelector('#cmp_summary').innerText.includes('🏁')", 60)
            assert [m for m, _ in itertools.groupby(engine.asked)] == ["Name three birds.", "And three fish?"]
            assert "Error" not in driver.find_element(By.TAG_NAME, "body").text
        finally:
            driver.get(home)
            wait_for(driver, "document.querySelector('#msg textarea')", 60)


def test_a_narrow_window_opens_at_the_top_with_code_lines_kept(page):
    driver, _ = page
    url = driver.current_url
    driver.set_window_size(400, 900)
    try:
        driver.get(url)
        wait_for(driver, "document.querySelector('#msg textarea')", 60)
        time.sleep(1.5)  # past the page script's delay
        assert driver.execute_script("return window.scrollY;") == 0
        # a code block keeps its lines (it scrolls sideways instead of wrapping them)
        driver.execute_script("const d = document.createElement('div'); d.className = 'eagle-tokens';"
                              "d.innerHTML = '<pre><code>x</code></pre>';"
                              "document.querySelector('#chat').appendChild(d);")  # fmt: skip
        pre = "getComputedStyle(document.querySelector('.eagle-tokens pre'))"
        assert driver.execute_script(f"return {pre}.whiteSpace;") == "pre"
    finally:
        driver.set_window_size(1400, 1000)
        driver.get(url)
        wait_for(driver, "document.querySelector('#msg textarea')", 60)
