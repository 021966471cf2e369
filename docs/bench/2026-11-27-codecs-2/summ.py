import json,glob,statistics as st,sys
def load(tag):
    rows={}
    for f in sorted(glob.glob(f'{tag}-*.json')):
        for r in json.load(open(f)):
            k=(r['op'],r['bits'],r.get('dtype'),r['numel']>>20)
            rows.setdefault(k,[]).append(r)
    return rows
GOAL={'quantize','quantize_h','deq_red_quant','drq_h'}
for lvl in sys.argv[1:]:
    b,a=load(f'before-{lvl}'),load(f'after-{lvl}')
    mem=[r['memcpy_gbps'] for v in a.values() for r in v]+[r['memcpy_gbps'] for v in b.values() for r in v]
    print(f"\n#### x86-64-{lvl}: memcpy {min(mem):.0f}-{max(mem):.0f} GB/s (median {st.median(mem):.0f})\n")
    rounds=len(glob.glob(f'after-{lvl}-*.json'))
    print(f"| op | bits | dtype | elements | before GB/s | after GB/s | after / before | before x memcpy | after x memcpy ({rounds} rounds) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k in sorted(a, key=lambda k:(k[0] not in GOAL, k[0], -k[1], k[2] or '', k[3])):
        bg=st.median(r['gbps'] for r in b[k]); ag=st.median(r['gbps'] for r in a[k])
        bx=st.median(r['x_memcpy'] for r in b[k]); ax=[r['x_memcpy'] for r in a[k]]
        axm=st.median(ax)
        mark = f"**{axm:.2f}**" if k[0] in GOAL and axm<0.6 else f"{axm:.2f}"
        print(f"| {k[0]} | {k[1]} | {k[2] if k[0] not in ('deq_red_quant','drq_h') else '-'} | {k[3]}M | {bg:.1f} | {ag:.1f} | {ag/bg:.2f} | {bx:.2f} | {mark} ({', '.join(f'{v:.2f}' for v in ax)}) |")
