#!/bin/bash
# Usage: ab.sh ROUNDS THREADS OPS SIZES DIR... with DIR a checkout (a path) whose extension is built in place;
# prints per op the median GB/s of each build over the rounds (each round runs every build once, in turn).
R=$1; T=$2; OPS=$3; SZ=$4; shift 4
for r in $(seq $R); do for v in "$@"; do
  PYTHONPATH=$v ${PYTHON:-python} "$(dirname "$0")/probe.py" $v $T $OPS $SZ | sed "s|^|$v |"
done; done > /tmp/ab.out
python3 - <<'P'
import collections, statistics
d=collections.defaultdict(list)
for l in open('/tmp/ab.out'):
    f=l.split(); d[(f[1],f[2],f[3],f[4],f[0])].append(float(f[5]))
keys=sorted({k[:4] for k in d})
vs=[]
for k in d:
    if k[4] not in vs: vs.append(k[4])
for k in keys:
    print(' '.join(k), '  '.join(f"{v}: {statistics.median(d[k+(v,)]):6.2f} [{min(d[k+(v,)]):.1f}-{max(d[k+(v,)]):.1f}]" for v in vs))
P
