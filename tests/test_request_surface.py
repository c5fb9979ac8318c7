"""The request surface around generation (issue 15): served model names, the context default and
its KV-cache cap, max_tokens clamping, reasoning_effort and `reasoning`, unknown fields, the
rejection and access logs, and the flags behind them."""
import threading
from types import SimpleNamespace

import pytest

from tests.conftest import make_chat_model, start_server, stop_server
from tests.test_api import THINK_TEMPLATE, call

PLAIN_TEMPLATE = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
KV_BLOCKS = 16  # x 16 tokens: the cache holds 256 tokens, so the model's 4096 is capped to 256


@pytest.fixture(scope="module")
def srv(tiny_llama_path, tmp_path_factory):
    """The tiny model (no EOS: it writes until max_tokens) with a plain template, given the <think> one
    by --chat-template; logging at info."""
    d = tmp_path_factory.mktemp("tiny_surface")
    path = make_chat_model(tiny_llama_path, d / "model", PLAIN_TEMPLATE)
    (d / "think.jinja").write_text(THINK_TEMPLATE)
    proc, base, _ = start_server("--m", path, "--num-kv-blocks", str(KV_BLOCKS), "--log-level", "info",
                                 "--served-model-name", "my-model", "alias-b", "--access-log",
                                 "--chat-template", str(d / "think.jinja"), "--tool-call-parser", "hermes")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # a full pipe would block it
    reader.start()
    from openai import OpenAI
    yield SimpleNamespace(base=base, client=OpenAI(base_url=base + "/v1", api_key="none", max_retries=0),
                          proc=proc, reader=reader, lines=lines)
    stop_server(proc)


HI = [{"role": "user", "content": "Hi"}]


def test_served_names_and_any_model_accepted(srv):
    c = srv.client
    assert [m.id for m in c.models.list().data] == ["my-model"]
    assert c.models.retrieve("alias-b").id == "my-model"
    from openai import NotFoundError
    with pytest.raises(NotFoundError):
        c.models.retrieve("something-else")
    for name in ("something-else", "default", "my-model"):
        r = c.chat.completions.create(model=name, messages=HI, max_tokens=2)
        assert r.model == "my-model"
    assert call(srv.base, "/v1/completions", {"model": "gpt-4", "prompt": "ab", "max_tokens": 1})[0] == 200


def test_strict_model_names():
    from xinfer.api.state import ApiOptions, ApiState
    s = SimpleNamespace(opts=ApiOptions(strict_model_names=True), model_names=["a", "b"], model_name="a")
    for ok in ("a", "b", "default", None):
        ApiState.check_model(s, ok)
    from xinfer.api.protocol import ApiError
    with pytest.raises(ApiError) as e:
        ApiState.check_model(s, "c")
    assert e.value.status == 404
    s.opts.strict_model_names = False
    ApiState.check_model(s, "c")


def test_context_defaults_to_the_model_and_is_capped_by_the_kv_cache(srv):
    from xinfer.config import EngineConfig
    assert EngineConfig().resolve_context({"max_position_embeddings": 32768}).max_model_len == 32768
    assert EngineConfig(max_model_len=100).resolve_context({"max_position_embeddings": 32768}).max_model_len == 100
    card = srv.client.models.list().data[0]
    assert card.max_model_len == KV_BLOCKS * 16
    assert call(srv.base, "/tokenize", {"prompt": "x"})[1]["max_model_len"] == KV_BLOCKS * 16


def test_max_tokens_over_the_room_is_clamped(srv):
    r = srv.client.chat.completions.create(model="m", messages=HI, max_tokens=10 ** 6)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == KV_BLOCKS * 16
    status, body = call(srv.base, "/v1/completions", {"prompt": [[5, 6], [5, 6, 7, 8, 9, 10]], "max_tokens": 10 ** 6})
    assert status == 200 and {c["finish_reason"] for c in body["choices"]} == {"length"}
    assert body["usage"]["completion_tokens"] == 2 * (KV_BLOCKS * 16 - 6)  # one max_tokens: the shortest room
    # A prompt that alone is over the context is still a 400.
    status, err = call(srv.base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"


def test_strict_max_tokens_is_the_400():
    from xinfer.errors import InvalidRequestError
    from xinfer.sampling_params import SamplingParams, check_request
    with pytest.raises(InvalidRequestError):
        check_request([1] * 10, SamplingParams(max_tokens=100), 128, 64)
    p = SamplingParams(max_tokens=100, min_tokens=80)
    check_request([1] * 10, p, 128, 64, clamp=True)
    assert (p.max_tokens, p.min_tokens) == (54, 54)


def test_reasoning_effort_none_and_the_reasoning_field(srv):
    c = srv.client
    r = c.chat.completions.create(model="m", messages=HI, max_tokens=8, temperature=0)
    msg = r.choices[0].message
    assert msg.reasoning_content and msg.reasoning == msg.reasoning_content
    chunks = list(c.chat.completions.create(model="m", messages=HI, max_tokens=8, temperature=0, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices and getattr(ch.choices[0].delta, "reasoning", None)]
    assert deltas and all(d.reasoning == d.reasoning_content for d in deltas)
    assert "".join(d.reasoning for d in deltas) == msg.reasoning
    off = c.chat.completions.create(model="m", messages=HI, max_tokens=8, temperature=0, reasoning_effort="none")
    assert off.choices[0].message.content and not getattr(off.choices[0].message, "reasoning", None)
    low = c.chat.completions.create(model="m", messages=HI, max_tokens=8, temperature=0, reasoning_effort="low")
    assert low.choices[0].message.reasoning == msg.reasoning


def test_chat_template_file_overrides_the_models(srv, tiny_llama_path, tmp_path):
    status, info = call(srv.base, "/tokenizer_info")
    assert status == 200 and info["chat_template"] == THINK_TEMPLATE and info["tool_parser"] == "qwen"
    from xinfer import Engine, EngineConfig
    path = make_chat_model(tiny_llama_path, tmp_path / "m", THINK_TEMPLATE)
    (tmp_path / "t.jinja").write_text(PLAIN_TEMPLATE)
    e = Engine(EngineConfig(model=path, num_kv_blocks=16, chat_template=str(tmp_path / "t.jinja")))
    assert e.tokenizer.apply_chat_template(HI, add_generation_prompt=True) == "Hi\n"
    with pytest.raises(ValueError, match="nope.jinja"):
        EngineConfig(chat_template=str(tmp_path / "nope.jinja"))


def test_cli_flags_after_the_command(monkeypatch):
    from xinfer import cli
    got = {}
    monkeypatch.setattr(cli, "launch", lambda config, host, port, log_level, *rest: got.update(
        level=log_level, opts=rest[-1]) or 0)
    monkeypatch.setattr(cli, "setup_logging", lambda *a: None)
    assert cli.main(["serve", "--log-level", "debug", "--strict-model-names", "--strict-max-tokens",
                     "--served-model-name", "a", "b"]) == 0
    assert got["level"] == "debug"
    assert got["opts"]["served_model_names"] == ["a", "b"]
    assert got["opts"]["strict_model_names"] and got["opts"]["strict_max_tokens"]
    assert cli.main(["--log-level", "error", "serve"]) == 0 and got["level"] == "error"
    for vllm, ours in (("hermes", "qwen"), ("llama3_json", "llama"), ("qwen3_coder", "qwen_coder"),
                       ("deepseek_v3", "deepseek"), ("mistral", "mistral"), ("pythonic", "pythonic")):
        assert cli.main(["serve", "--tool-call-parser", vllm]) == 0 and got["opts"]["enforce_parser"] == ours
    assert cli.main(["serve", "--tool-call-parser", "bogus"]) == 2


def test_continuous_usage_stats_count_up_in_every_chunk(srv):
    chunks = list(srv.client.chat.completions.create(
        model="my-model", messages=HI, max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5


def test_include_stop_str_in_output(tiny_llama_path, tmp_path):
    """The tiny model's text, cut at a stop string found in it: without, then with the stop string."""
    from xinfer import Engine, EngineConfig, SamplingParams
    e = Engine(EngineConfig(model=make_chat_model(tiny_llama_path, tmp_path / "m", PLAIN_TEMPLATE), num_kv_blocks=64))
    free = e.generate(["ab"], SamplingParams(temperature=0, max_tokens=30))[0].text
    stop = free[10:12]
    cut = free[:free.index(stop)]
    out = e.generate(["ab"], SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0]
    kept = e.generate(["ab"], SamplingParams(temperature=0, max_tokens=30, stop=[stop],
                                             include_stop_str_in_output=True))[0]
    assert (out.text, out.finish_reason) == (cut, "stop") and (kept.text, kept.finish_reason) == (cut + stop, "stop")


def test_include_stop_str_in_output_through_the_server(srv):
    def text(**kw):
        status, body = call(srv.base, "/v1/completions", {"prompt": "ab", "max_tokens": 30, "temperature": 0, **kw})
        assert status == 200, body
        return body["choices"][0]["text"]
    free = text()
    stop = free[10:12]
    assert text(stop=[stop]) == free[:free.index(stop)]
    assert text(stop=[stop], include_stop_str_in_output=True) == free[:free.index(stop)] + stop



def test_continue_final_message_through_the_server(srv):
    msgs = HI + [{"role": "assistant", "content": "Hel"}]
    status, body = call(srv.base, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2,
                                                           "continue_final_message": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    status, body = call(srv.base, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2,
                                                           "continue_final_message": True, "add_generation_prompt": True})
    assert status == 400 and body["error"]["param"] == "continue_final_message"


def test_request_chat_template_needs_the_flag(srv):
    """Without --trust-request-chat-template a request's own template is a 400 (vLLM's rule); the
    rest, with the flag on, is in tests/test_request_fields.py."""
    own = "{{ messages[0].content }}"
    for path, extra in (("/v1/chat/completions", {"chat_template": own}), ("/tokenize", {"chat_template": own}),
                        ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": own}})):
        status, err = call(srv.base, path, {"messages": HI, "max_tokens": 1, **extra})
        assert status == 400 and "--trust-request-chat-template" in err["error"]["message"], (path, err)


def test_bad_words_and_allowed_token_ids_through_the_server(srv):
    def completion(**kw):
        status, body = call(srv.base, "/v1/completions", {"prompt": "ab", "max_tokens": 20, "temperature": 0, **kw})
        assert status == 200, body
        return body["choices"][0]["text"]
    free = completion()
    assert free[3:5] not in completion(bad_words=[free[3:5]])
    assert call(srv.base, "/v1/completions", {"prompt": "ab", "allowed_token_ids": [10 ** 6]})[0] == 400

def test_unknown_fields_warned_once_and_requests_logged(srv):
    for _ in range(2):
        body = {"messages": HI, "max_tokens": 1, "frobnicate": {"x": [1]}, "top_a": 0.5}
        assert call(srv.base, "/v1/chat/completions", body)[0] == 200
    assert call(srv.base, "/v1/chat/completions", {"messages": HI, "top_p": 5})[0] == 400
    stop_server(srv.proc)  # the log is complete once the server is gone
    srv.reader.join(10)
    log = "".join(srv.lines)
    assert log.count("'frobnicate' is not supported") == 1 and log.count("'top_a' is not supported") == 1
    assert "max_model_len 4096 capped to 256" in log
    assert "rejected POST /v1/chat/completions: 400" in log and "top_p" in log
    assert "rejected GET /v1/models/something-else: 404 model_not_found" in log
    assert "POST /v1/chat/completions 200" in log and "GET /v1/models 200" in log


def test_continue_final_message_and_add_generation_prompt(tiny_llama_path, tmp_path):
    """What the template renders: the generation prompt on or off, or the last assistant turn left open."""
    from xinfer.api.protocol import ApiError, chat_text
    from xinfer.api.schema import ChatRequest, Message
    from xinfer.loader import load_model_info
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = load_model_info(make_chat_model(tiny_llama_path, tmp_path / "m", template)).tokenizer
    msgs = [Message(role="user", content="Hi"), Message(role="assistant", content="Hel")]

    def render(**kw):
        return chat_text(tok, ChatRequest(messages=msgs, **kw), None, True)

    assert render() == "<user>Hi</s><assistant>Hel</s><assistant>"
    assert render(add_generation_prompt=False) == "<user>Hi</s><assistant>Hel</s>"
    assert render(continue_final_message=True) == "<user>Hi</s><assistant>Hel"
    with pytest.raises(ApiError, match="add_generation_prompt"):
        render(continue_final_message=True, add_generation_prompt=True)


def test_allowed_token_ids_and_bad_words(tiny_llama_path, tmp_path):
    from xinfer import Engine, EngineConfig, SamplingParams
    e = Engine(EngineConfig(model=make_chat_model(tiny_llama_path, tmp_path / "m", PLAIN_TEMPLATE), num_kv_blocks=64))
    greedy = SamplingParams(temperature=0, max_tokens=40)
    free = e.generate(["ab"], greedy)[0]
    allowed = sorted(set(free.token_ids[:3]))
    only = e.generate(["ab"], SamplingParams(temperature=0, max_tokens=40, allowed_token_ids=allowed))[0]
    assert set(only.token_ids) <= set(allowed)
    pair = free.text[4:6]  # two characters the model writes: a two-token bad word
    banned = e.generate(["ab"], SamplingParams(temperature=0, max_tokens=40, bad_words=[pair, free.text[0]]))[0]
    assert pair not in banned.text and free.text[0] not in banned.text and len(banned.token_ids) == 40
    sampled = e.generate(["ab"] * 4, SamplingParams(temperature=1.0, max_tokens=40, seed=3, bad_words=[pair]))
    assert all(pair not in o.text for o in sampled)


def test_reasoning_parser_names_the_markers():
    import subprocess
    import sys
    from xinfer.parsers import reasoning_markers
    think = "{{ '<think>' }}"
    assert reasoning_markers(think) == ("<think>", "</think>")
    assert reasoning_markers(think, "none") is None  # no reasoning split, whatever the template says
    assert reasoning_markers(None, "mistral") == ("[THINK]", "[/THINK]")
    r = subprocess.run([sys.executable, "-m", "xinfer.cli", "serve", "--reasoning-parser", "bogus"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--reasoning-parser 'bogus' is not one of none, deepseek_r1" in r.stderr


def test_https_with_a_certificate(tmp_path, tiny_llama_path):
    """--ssl-certfile / --ssl-keyfile: the API answers HTTPS (a self-signed certificate made here)."""
    import json
    import ssl
    import subprocess
    import sys
    import time
    import urllib.request
    from tests.conftest import free_port
    cert, key = _self_signed(tmp_path)
    port = free_port()
    model = make_chat_model(tiny_llama_path, tmp_path / "m", PLAIN_TEMPLATE)
    proc = subprocess.Popen([sys.executable, "-m", "xinfer.cli", "--log-level", "warning", "serve", "--m", model,
                             "--port", str(port), "--num-kv-blocks", "32", "--ssl-certfile", str(cert),
                             "--ssl-keyfile", str(key)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    base = f"https://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                with urllib.request.urlopen(base + "/health", timeout=2, context=ctx) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.5)
        req = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": "ab", "max_tokens": 3}).encode())
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 3
    finally:
        stop_server(proc)


def _self_signed(folder):
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    import datetime
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file
