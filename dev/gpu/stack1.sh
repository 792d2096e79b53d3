#!/usr/bin/env bash
# First half of the CuTe DSL stack, and the peers, onto a fresh GPU machine (see README.md).
set -euo pipefail
mkdir -p /tmp/cute && cp .cute/a/* /tmp/cute/
if [ -d .peers/wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peers/wheels/*.whl
fi
ls /tmp/cute | head -20
