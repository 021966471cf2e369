#!/bin/bash
# Alternates the extension built from ffcfc91 (before) and from HEAD (after), five rounds at each CPU level.
set -e
cd /work/main
for r in 1 2 3 4 5; do
  for isa in x86-64-v4 x86-64-v3; do
    tag=${isa#x86-64-}
    (cd /work/conv-wt && PYTHONPATH=/work/conv-wt ../main/.venv/bin/python tools/bench_codecs.py --sizes 16M,64M --repeats 9 \
       --dtypes fp32,bf16 --ref-repeats 0 --cpu-isa $isa --json /work/ev-codecs/before-$tag-$r.json > /work/ev-codecs/before-$tag-$r.txt 2>&1)
    .venv/bin/python tools/bench_codecs.py --sizes 16M,64M --repeats 9 --dtypes fp32,bf16 --ref-repeats 0 \
       --cpu-isa $isa --json /work/ev-codecs/after-$tag-$r.json > /work/ev-codecs/after-$tag-$r.txt 2>&1
  done
done
echo finished
