"""A checkpoint folder's files as bytes, for "the committed checkpoint is what its script writes" checks.

The version stamps transformers and diffusers write into every JSON they save (``transformers_version``,
``_diffusers_version``) are dropped: they record the library that saved the files, not what the files hold, and a
new release of either (installed by CI from the registries) would otherwise fail the check with identical weights
and configs."""

from __future__ import annotations

import json
from pathlib import Path

STAMPS = ("transformers_version", "_diffusers_version")


def files(folder: Path) -> dict[str, bytes]:
    out = {}
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        if path.suffix == ".json":
            parsed = json.loads(data)
            if isinstance(parsed, dict) and any(k in parsed for k in STAMPS):
                # the rest of the file compared as written (key order and layout included)
                data = json.dumps({k: v for k, v in parsed.items() if k not in STAMPS}).encode()
        out[str(path.relative_to(folder))] = data
    return out
