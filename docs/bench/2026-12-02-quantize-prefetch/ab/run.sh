#!/bin/bash
cd /work/main
SO=megatron_zpp/_C.cpython-312-x86_64-linux-gnu.so
for r in 1 2 3 4; do
  for arm in old new; do
    cp /tmp/so_$([ $arm = old ] && echo env || echo new).so $SO
    ZPP_AHEAD=0 .venv/bin/python tools/bench_codecs.py --sizes 16M,64M --repeats 5 --dtypes fp32,bf16 --ops quantize,quantize_h --ref-repeats 0 --json /tmp/ab/r${r}_a${arm}.json > /tmp/ab/r${r}_a${arm}.txt 2>&1
  done
done
cp /tmp/so_new.so $SO
