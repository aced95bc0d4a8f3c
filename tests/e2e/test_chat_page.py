"""The chat page (`GET /`) in a real headless Chromium: SmolLM2's answer streams in, a long
one stops, the picker lists the model, tokens/s shows; with --require-auth the page asks for
the token, then answers.

Drives Debian's chromium through Debian's chromedriver with Selenium. Skipped only when those
are not installed (CI installs them in .ci/run); the SmolLM2 tests also need `atlas pull smollm2`.
"""

from __future__ import annotations

import re
import shutil

import httpx
import pytest
from conftest import DEVICE, LiveServer, tiny_server_args
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait

from atlas.app.model_store import is_model_folder, models_dir

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="Debian's chromium and chromedriver are not installed "
                              "(apt-get install chromium chromium-driver)"),
]

# Headless as root, and nothing reaching out to Google's hosts on its own.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1100,800"]
ANSWER_TIMEOUT_S = 300
TOKEN = "page-token"
LAST_ANSWER = ".message.assistant:last-of-type"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory):
    if not is_model_folder(models_dir() / "smollm2"):
        pytest.skip("SmolLM2 is not pulled (atlas pull smollm2)")
    live = LiveServer(["smollm2", "--device", DEVICE, "--max-seq-len", "1024", "--kv-cache-gb", "0.25"],
                      tmp_path_factory.mktemp("page-smollm2") / "server.log")
    yield live.wait_ready(timeout_s=300)
    live.stop()


@pytest.fixture(scope="module")
def auth_server(tiny_model, tmp_path_factory):
    live = LiveServer(tiny_server_args(tiny_model, "--require-auth", "--auth-token", TOKEN),
                      tmp_path_factory.mktemp("page-auth") / "server.log")
    yield live.wait_ready()
    live.stop()


def wait(browser, timeout_s: float = 60):
    return WebDriverWait(browser, timeout_s, poll_frequency=0.05)


def open_page(browser, server: LiveServer) -> None:
    """The page with nothing remembered from an earlier test (token, model)."""
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    wait(browser).until(lambda b: b.execute_script("return document.readyState") == "complete")


def model_names(browser) -> list[str]:
    return [option.text for option in Select(browser.find_element(By.ID, "model")).options]


def last_answer(browser):
    return browser.find_element(By.CSS_SELECTOR, LAST_ANSWER)


def answer_state(browser) -> str | None:
    answers = browser.find_elements(By.CSS_SELECTOR, LAST_ANSWER)
    return answers[0].get_attribute("data-state") if answers else None


def record_answer_lengths(browser) -> None:
    """Every length the answer's text takes, seen by the page itself (no polling races)."""
    browser.execute_script("""
        window.answerLengths = [];
        new MutationObserver(() => {
            const answer = document.querySelector(arguments[0] + ' .answer');
            if (answer) window.answerLengths.push(answer.textContent.length);
        }).observe(document.getElementById('conversation'),
                   {childList: true, subtree: true, characterData: true});
    """, LAST_ANSWER)


def ask(browser, question: str) -> None:
    browser.find_element(By.ID, "prompt").send_keys(question)
    browser.find_element(By.ID, "send").click()


def test_the_model_picker_lists_the_served_model(browser, smollm2_server):
    open_page(browser, smollm2_server)
    wait(browser).until(lambda b: model_names(b) == ["smollm2"])


def test_a_question_gets_smollm2s_answer_streamed_with_its_speed(browser, smollm2_server):
    open_page(browser, smollm2_server)
    wait(browser).until(lambda b: model_names(b))
    record_answer_lengths(browser)
    ask(browser, "What is the capital of France?")
    wait(browser, ANSWER_TIMEOUT_S).until(lambda b: answer_state(b) == "done")

    answer = last_answer(browser)
    text = answer.find_element(By.CLASS_NAME, "answer").text
    assert "Paris" in text
    lengths = browser.execute_script("return window.answerLengths")
    assert [n for n in lengths if 0 < n < len(text)], f"the answer did not grow in steps: {lengths}"
    stats = answer.find_element(By.CLASS_NAME, "stats").text
    assert re.search(r"^\d+ tokens · \d+\.\d tokens/s · first token after \d+\.\d\d s$", stats), stats
    assert browser.find_element(By.ID, "send").is_displayed()
    assert not browser.find_element(By.ID, "stop").is_displayed()
    assert browser.find_element(By.CSS_SELECTOR, ".message.user").text == "What is the capital of France?"


def labelled(server: LiveServer, name: str, label: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_stop_ends_a_long_answer_and_the_server_frees_it(browser, smollm2_server):
    open_page(browser, smollm2_server)
    wait(browser).until(lambda b: model_names(b))
    aborted = 'cause="client_disconnected"'
    aborted_before = labelled(smollm2_server, "atlas_requests_aborted_total", aborted)
    ask(browser, "Write a long story about a dragon who learns to fly.")
    wait(browser, ANSWER_TIMEOUT_S).until(
        lambda b: answer_state(b) == "streaming" and len(last_answer(b).find_element(By.CLASS_NAME, "answer").text) > 20)
    browser.find_element(By.ID, "stop").click()
    wait(browser).until(lambda b: answer_state(b) == "stopped")

    answer = last_answer(browser)
    assert answer.find_element(By.CLASS_NAME, "stats").text.endswith(" · stopped")
    assert not answer.find_elements(By.CLASS_NAME, "error")
    assert browser.find_element(By.ID, "send").is_displayed()
    wait(browser).until(lambda b: labelled(smollm2_server, "atlas_requests_aborted_total", aborted) > aborted_before)
    wait(browser).until(lambda b: smollm2_server.metrics()["atlas_num_requests_running"] == 0)


def test_an_api_error_shows_in_the_conversation(browser, server):
    open_page(browser, server)
    wait(browser).until(lambda b: model_names(b) == ["tiny"])
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys("one", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "two")
    assert prompt.get_attribute("value") == "one\ntwo"  # Shift+Enter is a new line, not a send
    assert not browser.find_elements(By.CSS_SELECTOR, ".message")
    browser.execute_script("arguments[0].value = 'word '.repeat(2000)", prompt)
    prompt.send_keys(Keys.ENTER)
    wait(browser).until(lambda b: answer_state(b) == "error")

    error = last_answer(browser).find_element(By.CSS_SELECTOR, ".error[role=alert]")
    assert error.text.startswith("Error 400: the prompt has ")
    assert "shorten the prompt" in error.text


# A stream as the API sends it once a reasoning parser is on (reasoning_content deltas), from a
# model that writes its own <think> block, tags split across chunks, cut into odd-sized reads.
REASONING_EVENTS = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "The user greets me. "}}]},
    {"choices": [{"index": 0, "delta": {"content": "<thi"}}]},
    {"choices": [{"index": 0, "delta": {"content": "nk>A reply is due.</th"}}]},
    {"choices": [{"index": 0, "delta": {"content": "ink>Hello, <b>friend</b>!"}, "finish_reason": "stop"}]},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}},
]


def fake_chat_stream(browser, events: list[dict]) -> None:
    """The page's chat requests answer `events` (cut into 7-byte reads) instead of reaching the
    server; their bodies are kept in `window.chatBodies`."""
    browser.execute_script("""
        const events = arguments[0].map((e) => `data: ${JSON.stringify(e)}\\n\\n`).join('') + 'data: [DONE]\\n\\n';
        const bytes = new TextEncoder().encode(events);
        const realFetch = window.fetch;
        window.chatBodies = [];
        window.fetch = (url, init) => {
            if (!String(url).endsWith('chat/completions')) return realFetch(url, init);
            window.chatBodies.push(JSON.parse(init.body));
            const body = new ReadableStream({start(controller) {
                for (let i = 0; i < bytes.length; i += 7) controller.enqueue(bytes.slice(i, i + 7));
                controller.close();
            }});
            return Promise.resolve(new Response(body, {headers: {'Content-Type': 'text/event-stream'}}));
        };
    """, events)


def test_reasoning_shows_collapsed_above_the_answer(browser, server):
    open_page(browser, server)
    wait(browser).until(lambda b: model_names(b))
    fake_chat_stream(browser, REASONING_EVENTS)
    ask(browser, "hi")
    wait(browser).until(lambda b: answer_state(b) == "done")

    answer = last_answer(browser)
    reasoning = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert reasoning.get_attribute("open") is None
    assert reasoning.find_element(By.TAG_NAME, "summary").text == "Reasoning"
    assert reasoning.get_attribute("textContent") == "ReasoningThe user greets me. A reply is due."
    assert answer.find_element(By.CLASS_NAME, "answer").text == "Hello, <b>friend</b>!"  # text, not markup
    assert not answer.find_elements(By.CSS_SELECTOR, ".answer b")
    assert answer.find_element(By.CLASS_NAME, "stats").text.startswith("9 tokens · ")


def test_a_follow_up_carries_the_conversation_and_new_chat_starts_over(browser, server):
    open_page(browser, server)
    wait(browser).until(lambda b: model_names(b))
    fake_chat_stream(browser, REASONING_EVENTS)
    for question in ["hi", "and then?"]:
        ask(browser, question)
        wait(browser).until(lambda b: answer_state(b) == "done")
    browser.find_element(By.ID, "new-chat").click()
    assert not browser.find_elements(By.CSS_SELECTOR, ".message")
    ask(browser, "again")
    wait(browser).until(lambda b: answer_state(b) == "done")

    reply = {"role": "assistant", "content": "Hello, <b>friend</b>!"}  # the answer, not its reasoning
    sent = [body["messages"] for body in browser.execute_script("return window.chatBodies")]
    assert sent == [[{"role": "user", "content": "hi"}],
                    [{"role": "user", "content": "hi"}, reply, {"role": "user", "content": "and then?"}],
                    [{"role": "user", "content": "again"}]]


def test_with_auth_the_page_asks_for_the_token_then_answers(browser, auth_server):
    open_page(browser, auth_server)
    token = browser.find_element(By.ID, "token")
    wait(browser).until(lambda b: token.is_displayed())
    status = browser.find_element(By.ID, "status")
    assert status.text == "This server asks for a bearer token: enter it above."
    assert model_names(browser) == []

    token.send_keys("wrong", Keys.ENTER)
    wait(browser).until(lambda b: "refused the token (401: invalid bearer token)" in status.text)
    token.clear()
    token.send_keys(TOKEN, Keys.ENTER)
    wait(browser).until(lambda b: model_names(b) == ["tiny"])
    assert status.text == ""

    browser.find_element(By.ID, "prompt").send_keys("Say something.", Keys.ENTER)
    wait(browser, ANSWER_TIMEOUT_S).until(lambda b: answer_state(b) == "done")
    assert last_answer(browser).find_element(By.CLASS_NAME, "answer").text.strip()

    browser.refresh()  # the token is remembered, and shown to be changed
    wait(browser).until(lambda b: model_names(b) == ["tiny"])
    assert browser.find_element(By.ID, "token").get_attribute("value") == TOKEN
    assert browser.find_element(By.ID, "status").text == ""
