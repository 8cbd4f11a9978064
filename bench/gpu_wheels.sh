#!/usr/bin/env bash
# The wheels bench/gpu_check.py needs on the GPU machine, which has python 3.12, torch, cupy, transformers,
# numpy... but no egglog, pydantic, diffusers and no network: run this on a networked machine, then carry .whl/
# with the repo (the device tool's `carry: [".whl"]`). Native libraries are stripped (egglog's 48.6 MB wheel holds
# an 11 MB library once stripped) and each wheel is repacked with a RECORD that matches, so pip installs it as is.
#
#   bench/gpu_wheels.sh                      # cp312 manylinux wheels into .whl/ (what the GPU machine needs)
#   bench/gpu_wheels.sh --python 3.11 --dest /tmp/whl311   # the same set for this machine's python (to test it)
#
# Not carried: libcublasLt (the cuBLASLt FP8 GEMMs, LUMINAL_FP8_GEMM=cublaslt). The nvidia-cublas wheel that holds
# it is several hundred MB; the GPU machine's torch (+cu130) already installed it, and runtimes/cuda/cublaslt.py
# finds it there (nvidia/*/lib, torch/lib, CUDA_HOME, the loader's path; $LUMINAL_CUBLASLT overrides). Without it
# fp8 weights are decoded to bf16 for cuBLAS, with a one-line notice.
#
# On the GPU machine gpu_check.py installs them itself:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
set -euo pipefail

PY=3.12
DEST=.whl
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY="$2"; shift 2 ;;
    --dest) DEST="$2"; shift 2 ;;
    *) echo "usage: $0 [--python 3.12] [--dest .whl]" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}
TAG="cp${PY/./}"

# Pinned to the versions this repository is tested with. egglog imports cloudpickle, graphviz (the Python package
# only), opentelemetry-api and black (with black's own dependencies); pydantic 2.13 needs typing-extensions >=
# 4.14.1 (newer than some torch installs carry); diffusers imports requests in its pipeline utilities.
PACKAGES=(
  egglog==13.2.0 cloudpickle==3.1.3 graphviz==0.21 opentelemetry-api==1.45.2
  black==26.10.1 mypy-extensions==1.1.0 pathspec==1.1.1 platformdirs==4.14.9 pytokens==0.4.1
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  typing-extensions==4.16.0
  diffusers==0.42.1 requests==2.34.2 urllib3==2.7.0 idna==3.20 charset-normalizer==3.4.7 certifi==2026.5.20
)

RAW=$(mktemp -d)
trap 'rm -rf "$RAW"' EXIT
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --abi "$TAG" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$RAW" "${PACKAGES[@]}" 2> >(grep -v "is ignored: it is neither" >&2)

# CUDA 13.0 headers (cuda_bf16.h, cuda_fp8.h, crt/) for NVRTC, used only when the GPU machine has none installed;
# kept apart (cuda-headers/) so that `pip install .whl/*.whl` does not install them
mkdir -p "$DEST/cuda-headers"
rm -f "$DEST"/*.whl "$DEST"/cuda-headers/*.whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST/cuda-headers" nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 \
  2> >(grep -v "is ignored: it is neither" >&2)
"$PYTHON" - "$RAW" "$DEST" <<'EOF'
"""Repack each wheel with its native libraries stripped (strip --strip-unneeded) and RECORD rewritten."""
import base64
import csv
import hashlib
import io
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

raw, dest = Path(sys.argv[1]), Path(sys.argv[2])


def digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


total_in = total_out = 0
for wheel in sorted(raw.glob("*.whl")):
    total_in += wheel.stat().st_size
    files: dict[str, bytes] = {}
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            files[info.filename] = z.read(info)
    record = next(name for name in files if name.endswith(".dist-info/RECORD"))
    for name, data in list(files.items()):
        if ".so" not in Path(name).name:
            continue
        with tempfile.NamedTemporaryFile(suffix=".so") as tmp:
            tmp.write(data)
            tmp.flush()
            subprocess.run(["strip", "--strip-unneeded", tmp.name], check=True)
            files[name] = Path(tmp.name).read_bytes()
    rows = []
    for row in csv.reader(io.StringIO(files[record].decode())):
        if not row:
            continue
        name = row[0]
        if name in files and name != record:
            rows.append([name, digest(files[name]), str(len(files[name]))])
        else:
            rows.append([name, "", ""])
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    files[record] = out.getvalue().encode()
    target = dest / wheel.name
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for name, data in files.items():
            z.writestr(name, data)
    total_out += target.stat().st_size
    print(f"{target.name:70s} {wheel.stat().st_size / 2**20:7.2f} MiB -> {target.stat().st_size / 2**20:6.2f} MiB")
headers = sum(w.stat().st_size for w in (dest / "cuda-headers").glob("*.whl"))
total_out += headers
print(f"cuda-headers/: {headers / 2**20:.2f} MiB (nvidia-cuda-runtime/-crt 13.0 wheels)")
print(f"total: {total_in / 2**20:.1f} MiB downloaded, {total_out / 2**20:.1f} MiB in {dest}/ (limit 60 MiB)")
if total_out > 60 * 2**20:
    sys.exit("the wheel set exceeds 60 MiB")
EOF
