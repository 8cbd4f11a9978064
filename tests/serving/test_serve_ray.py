"""`serve --ray`: the same HTTP API on Ray Serve replicas (the `ray` extra; skipped without it). A local Ray cluster
(2 CPUs), 2 replicas of the tiny Llama on 1 CPU each: concurrent requests are spread over both and answer the golden
reply; one replica killed mid-load: its requests end (a reply or an error status, never a hang) and Ray Serve
brings the service back to 2 replicas. The CLI's errors when Ray is absent are tested without Ray."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import pytest
from typer.testing import CliRunner

from serve_helpers import LLAMA_TINY, RECIPES, TEXTS

TIMEOUT = 60.0  # every request's bound: a request that hangs fails the test


def test_ray_flag_without_ray_names_the_extra(monkeypatch):
    from luminal_recipes.cli import app as cli

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    result = CliRunner().invoke(cli, ["serve", str(RECIPES / "llama.yaml"), "--ray", "--replicas", "2"])
    assert result.exit_code == 2
    assert "--ray" in result.output and "pip install 'luminal-recipes[ray]'" in result.output


def test_replicas_without_ray_is_refused():
    from luminal_recipes.cli import app as cli

    result = CliRunner().invoke(cli, ["serve", str(RECIPES / "llama.yaml"), "--replicas", "2"])
    assert result.exit_code == 2 and "--replicas" in result.output and "--ray" in result.output


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from luminal_recipes.serving.limits import Limits
    from luminal_recipes.serving.ray_serve import app

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app(RECIPES / "llama.yaml", weights=str(LLAMA_TINY), replicas=2, num_cpus=1, max_batch=4,
                      limits=Limits(max_tokens=64, max_queue=8)), name="luminal-recipe", route_prefix="/")
        yield ray, serve, f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _chat(url: str, prompt: str, max_tokens: int = 32) -> tuple[int, str | None, dict | None]:
    import httpx

    r = httpx.post(url + "/v1/chat/completions", timeout=TIMEOUT,
                   json={"model": "llama", "messages": [{"role": "user", "content": prompt}],
                         "max_tokens": max_tokens, "temperature": 0})
    try:
        body = r.json()
    except ValueError:
        body = {"text": r.text}
    return r.status_code, r.headers.get("x-luminal-replica"), body


def _concurrently(fn, n: int) -> list:
    results: list = [None] * n

    def one(i):
        try:
            results[i] = fn()
        except Exception as exc:  # noqa: BLE001 - a timeout or broken connection: reported by the test
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 30)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return results


def test_requests_spread_over_both_replicas(cluster):
    import httpx

    _, _, url = cluster
    want = json.loads((TEXTS / "llama-tiny-chat.json").read_text())
    results = _concurrently(lambda: _chat(url, want["prompt"]), 8)
    assert all(not isinstance(r, Exception) for r in results), results
    assert [r[0] for r in results] == [200] * 8, results
    # each replica's reply is the golden one (transformers' greedy generate), through the same API
    assert all(r[2]["choices"][0]["message"]["content"] == want["text"] for r in results)
    assert len({r[1] for r in results}) == 2, [r[1] for r in results]
    health = httpx.get(url + "/health", timeout=TIMEOUT)
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.headers["x-luminal-replica"]
    models = httpx.get(url + "/v1/models", timeout=TIMEOUT).json()
    assert models["data"][0]["kind"] == "text"


def test_a_killed_replica_fails_cleanly_and_is_replaced(cluster):
    ray, serve, url = cluster
    want = json.loads((TEXTS / "llama-tiny-chat.json").read_text())
    _, victim, _ = _chat(url, want["prompt"], max_tokens=1)
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(victim)]
    assert len(actors) == 1, actors
    handle = ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"])

    load: list = []
    loader = threading.Thread(target=lambda: load.extend(_concurrently(lambda: _chat(url, want["prompt"], 64), 8)))
    loader.start()
    time.sleep(1.5)  # the requests are being decoded on both replicas
    ray.kill(handle, no_restart=True)
    loader.join(TIMEOUT + 60)
    assert not loader.is_alive(), "the load hung after the replica was killed"
    assert len(load) == 8 and all(not isinstance(r, Exception) for r in load), load
    for status, _, body in load:  # a whole reply, or an error status with a body: never a half answer
        if status == 200:
            assert body["usage"]["completion_tokens"] == 64
        else:
            assert status >= 500 and body, (status, body)

    # the service recovers: Serve replaces the replica, and both answer again
    deadline = time.monotonic() + 90
    seen: set = set()
    while time.monotonic() < deadline and not (len(seen) == 2 and victim not in seen):
        results = _concurrently(lambda: _chat(url, want["prompt"], 8), 4)
        seen |= {r[1] for r in results if not isinstance(r, Exception) and r[0] == 200}
        seen.discard(victim)
        time.sleep(0.5)
    assert len(seen) == 2 and victim not in seen, seen
    status = serve.status().applications["luminal-recipe"]
    assert str(status.status).endswith("RUNNING"), status
