"""`luminal-recipe serve` with a language model (the tiny Llama checkpoint), driven by the official `openai`
client, httpx and curl: the replies are the goldens `run` regenerates (themselves transformers' generate for the
greedy ones), streamed as OpenAI's client parses them; errors are OpenAI error objects with the right status."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import LLAMA_TINY, RECIPES, TEXTS, Server  # noqa: E402

KEY = "test-secret-key"


def golden(name: str) -> dict:
    return json.loads((TEXTS / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def server():
    srv = Server(str(RECIPES / "llama.yaml"), "--weights", str(LLAMA_TINY), "--max-queue", "2", "--max-batch", "3",
                 "--max-tokens", "200", "--max-n", "4", "--max-body-bytes", "65536",
                 env={"LUMINAL_RECIPES_API_KEY": KEY})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_chat_is_the_golden_reply(client):
    want = golden("llama-tiny-chat")
    reply = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": want["prompt"]}],
                                           max_tokens=32, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want["text"]
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == len(want["ids"]) == 32
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 32 and reply.object == "chat.completion"


def test_chat_streams_the_same_reply(client):
    want = golden("llama-tiny-chat")
    stream = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": want["prompt"]}],
                                            max_completion_tokens=32, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 5 and "".join(pieces) == want["text"]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32


def test_completions_sample_as_run_does(client):
    """The sampled golden (temperature, top-k, top-p, seed), through /v1/completions with the extensions."""
    want = golden("llama-tiny-sampled")
    s = want["settings"]
    reply = client.completions.create(model="llama", prompt=want["prompt"], max_tokens=s["max_new_tokens"],
                                      temperature=s["temperature"], top_p=s["top_p"], seed=s["seed"],
                                      extra_body={"top_k": s["top_k"]})
    assert reply.choices[0].text == want["text"] and reply.usage.completion_tokens == len(want["ids"])
    other = client.completions.create(model="llama", prompt=want["prompt"], max_tokens=s["max_new_tokens"],
                                      temperature=s["temperature"], top_p=s["top_p"], seed=s["seed"] + 1,
                                      extra_body={"top_k": s["top_k"]})
    assert other.choices[0].text != want["text"]  # the seed is used
    # n choices: choice k samples with seed + k
    both = client.completions.create(model="llama", prompt=want["prompt"], max_tokens=s["max_new_tokens"],
                                     temperature=s["temperature"], top_p=s["top_p"], seed=s["seed"], n=2,
                                     extra_body={"top_k": s["top_k"]})
    assert [c.text for c in both.choices] == [want["text"], other.choices[0].text]
    assert [c.index for c in both.choices] == [0, 1]


def test_stream_of_multibyte_text_never_splits_a_character(client):
    """A prompt with accents and an emoji, on a byte-level tokenizer whose tokens are single bytes: each streamed
    piece is whole characters, and together they are the reply `run` gives (the golden ends at an EOS)."""
    want = golden("llama-tiny-plain")
    s = want["settings"]
    stream = client.completions.create(model="llama", prompt=want["prompt"], max_tokens=s["max_new_tokens"],
                                       temperature=0, stream=True,
                                       extra_body={"repetition_penalty": s["repetition_penalty"]})
    chunks = list(stream)
    pieces = [c.choices[0].text for c in chunks if c.choices[0].text]
    assert "".join(pieces) == want["text"]
    for piece in pieces:  # each piece is valid text on its own (a split character would not encode)
        assert piece.encode("utf-8").decode("utf-8") == piece
    assert chunks[-1].choices[0].finish_reason == "stop"  # the EOS ended it


def test_concurrent_requests_decoded_together_are_the_goldens(server):
    """Six requests at once on a server decoding three sequences together (--max-batch 3): prompts join between
    decode steps and replies leave as they end; each reply is still the golden `run` gives alone. (Past the
    queue of 2, the client retries after the 429's Retry-After.)"""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=8, timeout=120)
    cases = []
    for name in ("llama-tiny-chat", "llama-tiny-sampled", "llama-tiny-plain"):
        want = golden(name)
        s = want["settings"]
        cases.append((want, {"prompt": want["prompt"], "max_tokens": s["max_new_tokens"],
                             "temperature": s.get("temperature", 0), "top_p": s.get("top_p", 1),
                             "seed": s.get("seed", 0), "extra_body": {"top_k": s.get("top_k", 0),
                                                                      "repetition_penalty":
                                                                          s.get("repetition_penalty", 1.0)}},
                      s.get("chat", True)))
    got: dict[int, str] = {}

    def ask(k: int) -> None:
        want, args, chat = cases[k % 3]
        if chat:
            args = {k2: v for k2, v in args.items() if k2 != "prompt"}
            reply = client.chat.completions.create(model="llama", messages=[{"role": "user",
                                                                             "content": want["prompt"]}], **args)
            got[k] = reply.choices[0].message.content
        else:
            got[k] = client.completions.create(model="llama", **args).choices[0].text

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got.get(k) for k in range(6)] == [cases[k % 3][0]["text"] for k in range(6)]


def test_stop_strings_end_the_reply(client):
    want = golden("llama-tiny-chat")
    stop = want["text"][8:11]
    reply = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": want["prompt"]}],
                                           max_tokens=32, temperature=0, stop=[stop])
    assert reply.choices[0].message.content == want["text"][:want["text"].index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_curl_streams_server_sent_events(server):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    want = golden("llama-tiny-chat")
    body = json.dumps({"model": "llama", "messages": [{"role": "user", "content": want["prompt"]}],
                       "max_tokens": 32, "temperature": 0, "stream": True})
    out = subprocess.run([curl, "-sN", "-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json",
                          "-d", body, server.url + "/v1/chat/completions"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    events = [line[len("data: "):] for line in out.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if json.loads(e)["choices"])
    assert text == want["text"]


def test_api_key_guards_every_route_but_health(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_models_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == ["llama"]
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("luminal_queue_depth", "luminal_requests_total", "luminal_generated_tokens_total",
                 "luminal_time_to_first_token_seconds_bucket", "luminal_request_latency_seconds_bucket",
                 "luminal_generated_tokens_per_second"):
        assert name in text
    assert _generated(server) >= 32


def test_errors_are_openai_error_objects(client, server):
    headers = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(openai.NotFoundError, match="serves 'llama' only"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="at most 4"):
        client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}], n=5)
    with pytest.raises(openai.BadRequestError, match="at most 200 tokens per reply"):
        client.completions.create(model="llama", prompt="hi", max_tokens=201)
    with pytest.raises(openai.BadRequestError, match="leaves room for 156 in the model's context of 256") as caught:
        client.completions.create(model="llama", prompt=list(range(3, 103)), max_tokens=190)
    assert caught.value.status_code == 400 and caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="leaves no room"):
        client.completions.create(model="llama", prompt=list(range(3, 259)), max_tokens=1)
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers, json={"messages": "hi"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers,
                   json={"messages": [{"role": "user", "content": "x" * 70000}]})
    assert r.status_code == 413 and "65,536" in r.json()["error"]["message"]
    def chunked():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"x" * 5000
        yield b'"}]}'

    r = httpx.post(server.url + "/v1/chat/completions", headers=headers, content=chunked())
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = httpx.post(server.url + "/v1/embeddings", headers=headers, json={"input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers, content=b"{not json")
    assert r.status_code == 422 and "Traceback" not in r.text


def test_a_full_queue_answers_429_with_retry_after(server):
    body = {"model": "llama", "prompt": "def main():", "max_tokens": 150, "temperature": 0}
    statuses, retry = [], []

    def send():
        r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=300)
        statuses.append(r.status_code)
        if r.status_code == 429:
            retry.append(r.headers.get("retry-after"))
            assert r.json()["error"]["type"] == "rate_limit_error"

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses.count(200) >= 2 and 429 in statuses, statuses  # at least the two the queue holds
    assert set(statuses) == {200, 429} and all(r == "1" for r in retry)


def _generated(server) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("luminal_generated_tokens_total"))


def test_a_client_that_disconnects_cancels_its_reply(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    # a request whose whole reply is 200 tokens (no EOS before): what a cancelled one must stay below
    body = next((b for b in ({"prompt": p, "max_tokens": 200, "temperature": 0.7, "seed": seed}
                             for p in ("def main():", "The capital of France is") for seed in range(6))
                 if httpx.post(server.url + "/v1/completions", headers=headers, json=b,
                               timeout=120).json()["choices"][0]["finish_reason"] == "length"), None)
    assert body is not None, "no 200-token reply found to cancel"
    before = _generated(server)
    with httpx.stream("POST", server.url + "/v1/completions", headers=headers, json={**body, "stream": True},
                      timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert got[0].startswith("data: ")
    time.sleep(3.0)  # the worker notices at its next token
    spent = _generated(server) - before
    assert spent < 200, spent
    # the server is free again: a short request is answered
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_sigterm_finishes_the_request_in_flight_then_exits(server):
    """Last in this file: it stops the module's server."""
    body = {"prompt": "def main():", "max_tokens": 120, "temperature": 0}
    whole = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body,
                       timeout=120).json()["choices"][0]
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={**body, "stream": True}, timeout=120) as r:
        lines = r.iter_lines()
        first = next(lines)
        assert first.startswith("data: ")
        server.proc.terminate()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    pieces = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
    assert pieces[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    assert "".join(p["choices"][0]["text"] for p in pieces) == whole["text"]  # answered completely
    assert server.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")
