#!/usr/bin/env bash
# Copies flash_dma as of a commit into DIR/flash_dma_old, for bench/ab_packages.py.
#   bash bench/make_old_package.sh COMMIT DIR
set -euo pipefail
commit=$1 dir=$2
rm -rf "$dir/flash_dma_old" && mkdir -p "$dir"
git archive "$commit" flash_dma | tar -x -C "$dir"
mv "$dir/flash_dma" "$dir/flash_dma_old"
# absolute self-references (a few, in benchmarks and strings) follow the new name
grep -rl "flash_dma\." "$dir/flash_dma_old" | xargs -r sed -i 's/\bflash_dma\./flash_dma_old./g'
