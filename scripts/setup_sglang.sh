#!/usr/bin/env bash
# Build .venv-sglang: a separate environment holding real SGLang for the CPU path.
#
# SGLang 0.5.23 pins torch==2.14.1 (CUDA) and transformers==5.19.0, and needs sgl_kernel, which has
# no CPU wheel. A server is its own process, so it runs from this venv, never from the project's.
# What this does (each step idempotent; re-running is cheap once done):
#   1. python3.11 -m venv .venv-sglang ; upgrade pip
#   2. torch==2.13.0+cpu (the CPU wheel, from the find-links /opt/wheels or the PyTorch CPU index)
#   3. sglang, torchvision, sglang-router with --no-deps (their own deps would pull a CUDA torch)
#   4. sglang's non-CUDA requirements (scripts/sglang-cpu-requirements.txt) under
#      scripts/sglang-cpu-lock.txt and torch==2.13.0+cpu as constraints
#   5. torchvision: its fake-op registration for torchvision::nms/qnms made conditional on its
#      C++ ops being loadable (the PyPI wheel links CUDA libs and cannot load them here)
#   6. the pure-torch sgl_kernel stand-in (scripts/sglang_cpu/sgl_kernel.py) as module sgl_kernel
#   7. checks: torch is +cpu, no nvidia-* / CUDA packages, `import sglang.launch_server` works
# Usage: scripts/setup_sglang.sh [VENV_DIR]   (env: PYTHON=python3.11, SGLANG_VERSION=0.5.23)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3.11}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="2.13.0+cpu"
TORCHVISION_VERSION="0.28.0"   # the torchvision built against torch 2.13.0
ROUTER_VERSION="0.3.2"
REQS="$ROOT/scripts/sglang-cpu-requirements.txt"
LOCK="$ROOT/scripts/sglang-cpu-lock.txt"
STANDIN="$ROOT/scripts/sglang_cpu/sgl_kernel.py"
export PIP_DISABLE_PIP_VERSION_CHECK=1

say() { echo "[setup_sglang] $*"; }
die() { echo "[setup_sglang] ERROR: $*" >&2; exit 1; }
start=$(date +%s)

command -v "$PYTHON" >/dev/null || die "$PYTHON not found (SGLang's CPU path needs Python 3.11)"
for f in "$REQS" "$LOCK" "$STANDIN"; do [ -f "$f" ] || die "missing $f"; done

STAMP="$VENV/.rlake-sglang-stamp"
WANT="$(cat "$REQS" "$LOCK" "$STANDIN" "$0" | sha256sum | cut -c1-16) sglang=$SGLANG_VERSION"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  say "$VENV is up to date ($WANT); nothing to do"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating venv $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV" || die "venv creation failed"
fi
PY="$VENV/bin/python"
# pip, minus the find-links noise ("Location ... is ignored"), keeping pip's exit status
pipi() {
  local rc=0 log
  log="$(mktemp)"
  "$PY" -m pip install --quiet --progress-bar off "$@" > "$log" 2>&1 || rc=$?
  grep -v -E "is ignored: it is neither|^sglang .* requires|dependency resolver|^\s*$" "$log" || true
  rm -f "$log"
  return "$rc"
}

say "upgrading pip"
pipi --upgrade pip || die "pip upgrade failed"

CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
{ echo "torch==$TORCH_VERSION"; grep -v '^#' "$LOCK"; } > "$CONSTRAINTS"

say "installing torch==$TORCH_VERSION (CPU wheel)"
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu where the wheel is not in pip's find-links
pipi "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
  || die "torch==$TORCH_VERSION not found: put the CPU wheel in pip's find-links or set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"

say "installing sglang==$SGLANG_VERSION, torchvision==$TORCHVISION_VERSION, sglang-router==$ROUTER_VERSION (--no-deps)"
pipi --no-deps "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION" \
  "sglang-router==$ROUTER_VERSION" || die "installing sglang/torchvision/sglang-router failed"

say "installing sglang's non-CUDA requirements ($(grep -cv '^\s*#' "$REQS") lines of $(basename "$REQS"))"
pipi -r "$REQS" -c "$CONSTRAINTS" || die "installing $(basename "$REQS") failed"
"$PY" -c "import transformers, xgrammar, fastapi, zmq" || die "requirement install incomplete (see pip output above)"

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

say "torchvision: making the torchvision::nms/qnms fake registrations conditional"
"$PY" - "$SITE/torchvision/_meta_registrations.py" <<'EOF' || die "patching torchvision failed"
import re, sys
path = sys.argv[1]
src = open(path).read()
pat = re.compile(r'^@torch\.library\.register_fake\("(torchvision::q?nms)"\)$', re.M)
new, n = pat.subn(
    r'@(torch.library.register_fake("\1") if torchvision.extension._has_ops() else (lambda fn: fn))', src)
if n:
    open(path, "w").write(new)
    print(f"[setup_sglang]   patched {n} registrations in {path}")
elif "torchvision.extension._has_ops() else (lambda fn: fn)" in src:
    print("[setup_sglang]   already patched")
else:
    sys.exit(f"{path}: expected torchvision::nms register_fake lines not found")
EOF

say "installing the sgl_kernel CPU stand-in -> $SITE/sgl_kernel.py"
install -m 644 "$STANDIN" "$SITE/sgl_kernel.py"

say "checking the environment"
"$PY" - <<'EOF' || die "environment check failed"
import importlib.metadata as md
import torch
assert torch.__version__.endswith("+cpu"), f"torch is {torch.__version__}, expected the +cpu build"
bad = sorted(d.metadata["Name"] for d in md.distributions()
             if d.metadata["Name"].lower().startswith(("nvidia-", "cuda-")))
assert not bad, f"CUDA packages were pulled in: {bad}"
print(f"[setup_sglang]   torch {torch.__version__}, sglang {md.version('sglang')}, "
      f"transformers {md.version('transformers')}, sglang-router {md.version('sglang-router')}")
EOF
SGLANG_USE_CPU_ENGINE=1 "$PY" -c "import sglang.launch_server, sglang_router.launch_router" \
  || die "import sglang.launch_server failed in $VENV"

echo "$WANT" > "$STAMP"
say "done in $(( $(date +%s) - start )) s: $VENV ($(du -sh "$VENV" | cut -f1))"
