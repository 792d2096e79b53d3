#!/usr/bin/env bash
# First halves onto a fresh GPU machine (see README.md): whichever of .cute/a (CuTe DSL + FA4) and
# .qla/a (FlashQLA + TileLang) this call carries, and the peers' wheels (.peers) if carried.
set -euo pipefail
if [ -d .cute/a ]; then mkdir -p /tmp/cute && cp .cute/a/* /tmp/cute/ && echo "CuTe first half copied"; fi
if [ -d .qla/a ]; then mkdir -p /tmp/qla && cp .qla/a/* /tmp/qla/ && echo "FlashQLA first half copied"; fi
if [ -d .peers/wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peers/wheels/*.whl
  echo "peers installed"
fi
