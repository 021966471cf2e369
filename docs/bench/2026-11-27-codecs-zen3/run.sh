#!/bin/bash
# Alternates the extension built from dc6c376 (before, /work/base) and from HEAD (after), 3 rounds, x86-64-v3.
set -e
for r in 1 2 3; do
  (cd /work/base && PYTHONPATH=/work/base /work/main/.venv/bin/python tools/bench_codecs.py --sizes 16M,64M --repeats 9 \
     --dtypes fp32,bf16 --ref-repeats 0 --json /work/ev3/before-v3-$r.json > /work/ev3/before-v3-$r.txt 2>&1)
  (cd /work/main && .venv/bin/python tools/bench_codecs.py --sizes 16M,64M --repeats 9 --dtypes fp32,bf16 --ref-repeats 0 \
     --json /work/ev3/after-v3-$r.json > /work/ev3/after-v3-$r.txt 2>&1)
done
echo finished
