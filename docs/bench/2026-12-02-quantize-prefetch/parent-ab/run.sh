#!/bin/bash
# parent (f0bcace) vs new (94381f2 code), alternating: DRAM rounds (bench_codecs) and in-cache one-thread runs
cd /work/main
SO=megatron_zpp/_C.cpython-312-x86_64-linux-gnu.so
OUT=$1
mkdir -p $OUT/dram $OUT/incache
for r in 1 2 3 4; do
  for arm in parent new; do
    cp /tmp/so_$arm.so $SO
    .venv/bin/python tools/bench_codecs.py --sizes 16M,64M --repeats 5 --dtypes fp32,bf16 --ops quantize,quantize_h \
      --ref-repeats 0 --json $OUT/dram/r${r}_a$arm.json > $OUT/dram/r${r}_a$arm.txt 2>&1
    echo -n "$arm " >> $OUT/incache/out.txt
    .venv/bin/python docs/bench/2026-12-02-quantize-prefetch/incache.py quantize 1 2>&1 | grep -v Warn >> $OUT/incache/out.txt
  done
done
cp /tmp/so_new.so $SO
