"""The web chat page in a real headless Chromium (Debian's, driven by Selenium; nothing is downloaded):
`xinfer serve --ui-server` on a tiny model, the page on port + 1 streams a reply, shows the model and the
speed, Stop aborts the request on the server, and the page fetches nothing from another host."""
import json
import os
import re
import shutil
import tempfile
import time
import urllib.request
from urllib.parse import urlsplit

import pytest

from tests.conftest import make_chat_model, start_server, stop_server

os.environ.setdefault("SE_OFFLINE", "true")  # selenium-manager must never download a browser or driver
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def chat_model(tiny_llama_path, tmp_path_factory):
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return make_chat_model(tiny_llama_path, tmp_path_factory.mktemp("tiny_chat"), template)


@pytest.fixture(scope="module")
def ui_server(chat_model):
    proc, base, _ = start_server("--m", chat_model, "--ui-server", "--kv-cache-gb", "0.1")
    port = int(base.rsplit(":", 1)[1])
    ui = f"http://127.0.0.1:{port + 1}"
    try:
        with urllib.request.urlopen(ui + "/", timeout=10) as r:
            assert r.status == 200
    except OSError as e:
        proc.kill()
        pytest.fail(f"--ui-server: nothing serves the chat page on port {port + 1}: {e}")
    yield base, ui
    stop_server(proc)


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install '.[test]')")
    from selenium.webdriver.chrome.service import Service
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not found: apt-get install chromium chromium-driver "
                    "(scripts/dev.sh test installs them when it can)")
    profile = tempfile.mkdtemp(prefix="xinfer-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-default-apps", "--disable-extensions", "--window-size=1200,900",
              f"--user-data-dir={profile}"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def wait_for(cond, timeout=30.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def js(driver, script, *args):
    return driver.execute_script(script, *args)


def last_reply(driver) -> str:
    return js(driver, "const m = [...document.querySelectorAll('#messages .msg.assistant .content')];"
                      "return m.length ? m[m.length - 1].textContent : '';")


def set_field(driver, id_, value):
    js(driver, "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
               "e.dispatchEvent(new Event('change'));", id_, str(value))


def send(driver, text):
    box = driver.find_element("id", "input")
    box.clear()
    box.send_keys(text)
    driver.find_element("id", "send").click()


def idle(driver) -> bool:
    return driver.find_element("id", "send").is_enabled() and not driver.find_element("id", "stop").is_enabled()


def running_requests(base) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        m = re.search(r"^xinfer:num_requests_running\{[^}]*\} (\S+)$", r.read().decode(), re.M)
    return float(m.group(1))


@pytest.fixture(scope="module")
def page(ui_server, browser):
    base, ui = ui_server
    browser.get(ui + "/")
    with urllib.request.urlopen(base + "/v1/models") as r:
        model = json.loads(r.read())["data"][0]["id"]
    wait_for(lambda: browser.find_element("id", "model").text == model, 15, "the model name on the page")
    return browser


def test_page_loads_nothing_from_another_host(ui_server, page):
    ui = ui_server[1]
    urls = js(page, "return [location.href].concat(performance.getEntriesByType('resource').map(e => e.name));")
    assert any("/v1/models" in u for u in urls)  # the page's own fetches are seen here
    hosts = {urlsplit(u).hostname for u in urls if not u.startswith(("data:", "blob:", "about:"))}
    assert hosts <= {"127.0.0.1", "localhost"}, hosts
    html = urllib.request.urlopen(ui + "/").read().decode()
    assert not re.search(r"""(src|href|url)\s*[=(]\s*["']?(https?:)?//""", html)  # no CDN, no fonts


def test_markdown_is_rendered_and_escaped(page):
    html = js(page, "return renderMarkdown(arguments[0]);",
              "# Title\n**bold** and *it* `x<y`\n- one\n- two\n\n<img src=x onerror=alert(1)>\n"
              "[ok](https://example.org) [bad](javascript:alert(1))\n```python\nprint('<b>')\n```")
    assert "<h1>Title</h1>" in html and "<strong>bold</strong>" in html and "<em>it</em>" in html
    assert "<code>x&lt;y</code>" in html and "<ul><li>one</li><li>two</li></ul>" in html
    assert "<img" not in html and "&lt;img" in html
    assert 'href="https://example.org"' in html and 'rel="noopener' in html and "javascript:" not in html.split("[bad]")[0]
    assert "href=\"javascript" not in html
    assert 'class="codeblock"' in html and 'class="copy"' in html and "print(&#39;&lt;b&gt;&#39;)" in html
    # A reply that keeps "<think>…</think>" in its content is split client-side too (folded while thinking).
    assert js(page, "return splitThink('<think>hmm') ;") == {"reasoning": "hmm", "content": "", "thinking": True}
    assert js(page, "return splitThink('<think>hmm</think>Hi');") == {"reasoning": "hmm", "content": "Hi",
                                                                      "thinking": False}


def test_reply_streams_with_speed(page):
    set_field(page, "max-tokens", 200)
    set_field(page, "temperature", 0.7)
    # Record the reply's length at every DOM change: a streamed reply grows in many steps.
    js(page, """window.__lens = [];
        new MutationObserver(() => {
          const m = [...document.querySelectorAll('#messages .msg.assistant .content')];
          if (m.length) window.__lens.push(m[m.length - 1].textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});""")
    send(page, "Hello there!")
    wait_for(lambda: last_reply(page), 30, "the first streamed text")
    wait_for(lambda: idle(page), 60, "the reply to finish")
    lens = js(page, "return window.__lens;")
    grew = sum(b > a for a, b in zip(lens, lens[1:]))
    assert grew >= 3, lens  # grew over time (rendering markdown may also shrink it now and then)
    assert len(last_reply(page)) > 0
    speed = page.find_element("id", "speed").text
    assert re.search(r"^200 tokens · [\d.]+ tok/s$", speed), speed  # the count is from the usage chunk
    assert "Hello there!" in page.find_element("id", "messages").text


def test_stop_aborts_the_request(ui_server, page):
    base = ui_server[0]
    set_field(page, "max-tokens", 3500)
    n_before = js(page, "return document.querySelectorAll('#messages .msg.assistant').length;")
    send(page, "Tell me a long story.")
    wait_for(lambda: js(page, "return document.querySelectorAll('#messages .msg.assistant').length;") > n_before,
             10, "a new reply")
    wait_for(lambda: len(last_reply(page)) > 20, 30, "the reply to start streaming")
    wait_for(lambda: running_requests(base) >= 1, 10, "the request running on the server")
    page.find_element("id", "stop").click()
    wait_for(lambda: idle(page), 10, "the page to stop")
    n = len(last_reply(page))
    time.sleep(1.0)
    assert len(last_reply(page)) == n < 3500  # stopped mid-stream, and stays stopped
    assert "(stopped)" in page.find_element("id", "messages").text
    wait_for(lambda: running_requests(base) == 0, 5, "xinfer:num_requests_running back to 0")
    # The conversation goes on after a stop.
    set_field(page, "max-tokens", 5)
    send(page, "Short one.")
    wait_for(lambda: idle(page) and page.find_element("id", "speed").text.startswith("5 tokens"), 30,
             "a third reply")


def test_errors_are_shown_and_new_chat_clears(page):
    set_field(page, "top-p", 5)  # out of (0, 1]: HTTP 400 with an OpenAI error body
    send(page, "A bad setting")
    wait_for(lambda: idle(page) and page.find_elements("css selector", "#messages .msg .error"), 15, "the error")
    err = page.find_element("css selector", "#messages .msg .error").text
    assert "top_p" in err, err
    set_field(page, "top-p", 1)
    page.find_element("id", "new-chat").click()
    assert not page.find_elements("css selector", "#messages .msg")
    set_field(page, "max-tokens", 3)
    send(page, "Again")
    wait_for(lambda: idle(page) and page.find_element("id", "speed").text.startswith("3 tokens"), 30, "a reply")
    assert js(page, "return state.history.length;") == 2


@pytest.fixture(scope="module")
def origins():
    """Two blank pages on their own origins (ports): the first allowed by --allowed-origins."""
    import http.server
    import socketserver
    import threading

    class Blank(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<!doctype html><title>other origin</title>")

        def log_message(self, *a):
            pass
    class Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
        daemon_threads = True  # a connection the browser keeps open never holds up the shutdown

    servers = [Server(("127.0.0.1", 0), Blank) for _ in range(2)]
    for srv in servers:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{srv.server_address[1]}" for srv in servers]
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_cors_preflight_in_the_browser(chat_model, origins, browser):
    """A page on an allowed origin calls the API with a JSON POST (the browser sends a real
    preflight first) and reads the reply; a page on another origin is refused by the browser."""
    allowed, other = origins
    proc, base, _ = start_server("--m", chat_model, "--kv-cache-gb", "0.1", "--allowed-origins", allowed)
    call = ("const done = arguments[arguments.length - 1];"
            "fetch(arguments[0] + '/v1/chat/completions', {method: 'POST', headers: {'Content-Type': "
            "'application/json'}, body: JSON.stringify({messages: [{role: 'user', content: 'Hi'}], max_tokens: 3})})"
            ".then(r => r.json()).then(j => done('ok:' + j.choices.length), e => done('failed:' + e));")
    try:
        browser.get(allowed + "/")
        assert browser.execute_async_script(call, base) == "ok:1"
        browser.get(other + "/")
        assert browser.execute_async_script(call, base).startswith("failed:")
    finally:
        stop_server(proc)
