"""Start `luminal-recipe serve` as a subprocess on 127.0.0.1 (a free port it picks and prints) for the tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
TEXTS = ROOT / "tests" / "golden" / "texts"
LLAMA_TINY = ROOT / "tests" / "golden" / "checkpoints" / "llama-tiny"
READY = re.compile(r"on http://127\.0\.0\.1:(\d+)")


class Server:
    def __init__(self, *args: str, env: dict | None = None, timeout: float = 900.0):
        cmd = [sys.executable, "-m", "luminal_recipes", "serve", *args, "--port", "0", "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **(env or {})}, cwd=ROOT)
        self.log: list[str] = []
        self.port: int | None = None
        found = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                self.log.append(line)
                match = READY.search(line)
                if match and self.port is None:
                    self.port = int(match[1])
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found.wait(1.0):
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("the server did not start:\n" + "".join(self.log))
        if self.port is None:
            raise RuntimeError("the server exited before listening:\n" + "".join(self.log))
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
