#!/bin/bash
# The distance sweep: the experiment's build (ZPP_AHEAD read from the environment, 0 = the earlier step-start
# prefetch) in /tmp/so_env.so, three alternating rounds of each distance. Run from the repository root.
SO=megatron_zpp/_C.cpython-312-x86_64-linux-gnu.so
OUT=docs/bench/2026-12-02-quantize-prefetch/distance
cp $SO /tmp/so_keep.so && cp /tmp/so_env.so $SO
for r in 1 2 3; do
  for a in 0 2048 4096 8192 16384; do
    ZPP_AHEAD=$a .venv/bin/python tools/bench_codecs.py --sizes 16M,64M --repeats 5 --dtypes fp32,bf16 \
      --ops quantize,quantize_h --ref-repeats 0 --json $OUT/r${r}_a${a}.json > $OUT/r${r}_a${a}.txt 2>&1
  done
done
cp /tmp/so_keep.so $SO
