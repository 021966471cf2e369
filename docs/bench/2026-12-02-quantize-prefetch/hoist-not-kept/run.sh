#!/bin/bash
# in-cache A/B, one thread: G values/s (outputs for the fused ops), builds alternated
cd /work/main
SO=megatron_zpp/_C.cpython-312-x86_64-linux-gnu.so
for r in 1 2 3 4 5; do
  for arm in base new; do
    cp /tmp/so_$arm.so $SO
    echo -n "$arm " ; .venv/bin/python docs/bench/2026-12-02-quantize-prefetch/incache.py fused 1 2>&1 | grep -v Warn
  done
done
cp /tmp/so_new.so $SO
