#!/bin/bash
cd /work/main
OUT=$1; mkdir -p $OUT/dram $OUT/incache
for r in 1 2 3 4; do
  for v in 0 1 2 3; do
    ZPP_PFV=$v .venv/bin/python tools/bench_codecs.py --sizes 16M,64M --repeats 5 --dtypes fp32,bf16 --ops quantize,quantize_h \
      --ref-repeats 0 --json $OUT/dram/r${r}_a$v.json > $OUT/dram/r${r}_a$v.txt 2>&1
    echo -n "v$v " >> $OUT/incache/out.txt
    ZPP_PFV=$v .venv/bin/python docs/bench/2026-12-02-quantize-prefetch/incache.py quantize+yardstick 1 2>&1 | grep -v Warn >> $OUT/incache/out.txt
  done
done
