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
from serve_helpers import LLAMA_TINY, RECIPES, TEXTS
from typer.testing import CliRunner

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
    import os

    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from luminal_recipes.serving.limits import Limits
    from luminal_recipes.serving.ray_serve import PROXY_CALLBACK, PROXY_CALLBACK_ENV, app

    port = _free_port()
    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK  # the proxy's errors as JSON error objects (docs/serving.md)
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
            os.environ.pop(PROXY_CALLBACK_ENV, None)


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


def _replica_actor(ray, replica: str):
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(replica)]
    assert len(actors) == 1, actors
    return ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"])


def test_a_killed_replica_fails_cleanly_and_is_replaced(cluster):
    ray, serve, url = cluster
    want = json.loads((TEXTS / "llama-tiny-chat.json").read_text())
    _, victim, _ = _chat(url, want["prompt"], max_tokens=1)
    handle = _replica_actor(ray, victim)

    # a steady load: 6 clients, each sending one request after another until told to stop
    stop, log, lock = threading.Event(), [], threading.Lock()

    def client():
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                outcome = _chat(url, want["prompt"], 64)
            except Exception as exc:  # noqa: BLE001 - a timeout or a broken connection: fails the test below
                outcome = exc
            with lock:
                log.append((t0, time.monotonic(), outcome))

    clients = [threading.Thread(target=client) for _ in range(6)]
    for t in clients:
        t.start()
    time.sleep(2.0)
    killed = time.monotonic()
    ray.kill(handle, no_restart=True)
    time.sleep(4.0)
    stop.set()
    for t in clients:
        t.join(TIMEOUT + 30)
    assert not any(t.is_alive() for t in clients), "a request hung after the replica was killed"
    assert all(not isinstance(o, Exception) for *_, o in log), [o for *_, o in log if isinstance(o, Exception)]
    in_flight = [o for t0, t1, o in log if t0 < killed < t1]
    assert in_flight, "no request was in flight when the replica was killed"
    for _, _, (status, _, body) in log:  # a whole reply, or an error status with a body: never a half answer
        if status == 200:
            assert body["usage"]["completion_tokens"] == 64
        else:  # the proxy's error for a request its replica died with: an error object, retry later
            assert status == 503 and body["error"]["code"] == "replica_unavailable", (status, body)
    after = [o for t0, _, o in log if t0 > killed + 1.0]
    assert after and all(o[0] == 200 for o in after), after  # the survivor serves while the replica is replaced
    print(f"\nkill: {len(log)} requests, {len(in_flight)} in flight at the kill: "
          f"{sorted(o[0] for o in in_flight)}; errors: {[(o[0], o[2]) for *_, o in log if o[0] != 200][:3]}")

    # the service recovers: Serve replaces the replica, and both answer again
    deadline = time.monotonic() + 90
    seen: set = set()
    while time.monotonic() < deadline and len(seen) < 2:
        results = _concurrently(lambda: _chat(url, want["prompt"], 16), 4)
        seen |= {r[1] for r in results if not isinstance(r, Exception) and r[0] == 200} - {victim}
    assert len(seen) == 2, seen
    print(f"recovered: replicas {sorted(seen)} {time.monotonic() - killed:.1f} s after the kill")
    assert str(serve.status().applications["luminal-recipe"].status).endswith("RUNNING")
