"""Freed heap memory goes back to the system (``luminal_recipes.heap``), e.g. after loading the Tekken
tokenizer. Each measurement runs in a fresh interpreter, whose heap holds nothing else."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from luminal_recipes import heap

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "recipes" / "flux2-tiny" / "checkpoint" / "tokenizer"
glibc = pytest.mark.skipif(not heap.trim(), reason="needs glibc's malloc_trim (Linux)")

RSS = textwrap.dedent("""
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
""")


def _run(code: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", RSS + textwrap.dedent(code)], capture_output=True, text=True,
                          check=True)
    return [int(v) for v in done.stdout.split()]


@glibc
def test_trim_returns_a_freed_burst_of_small_allocations():
    before, freed, trimmed = _run("""
        from luminal_recipes import heap
        before = rss()
        burst = [bytearray(4000) for _ in range(20000)]  # 80 MB in malloc's heap (above pymalloc's 512 bytes)
        keep = bytearray(4000)  # above the burst: free() alone cannot shrink the heap's top
        del burst
        freed = rss()
        heap.trim()
        print(before, freed, rss())
    """)
    assert freed - before > 60 * 2**20  # glibc kept the freed burst resident...
    assert trimmed - before < 20 * 2**20  # ...until trimmed


@glibc
def test_loading_the_tekken_tokenizer_keeps_only_the_tokenizer_resident():
    """Parsing the 7 MB tokenizer.json allocates ~190 MiB; ~50 MiB of it is the tokenizer (before the trim the
    whole 190 MiB stayed resident)."""
    before, after = _run(f"""
        import tokenizers
        from luminal_recipes.text.tokenizer import load_tokenizer_json
        before = rss()
        folder, tok = load_tokenizer_json({str(TOKENIZER)!r}, "")
        assert tok.encode("a red fox").ids
        print(before, rss())
    """)
    assert after - before < 100 * 2**20, f"{(after - before) / 2**20:.0f} MiB resident after loading"
