import statistics as st
for tag in ("old-sdp4bit", "new-sdp4bit", "new-zeropp"):
    rows = {r: [l.split() for l in open(f"/tmp/skew/{tag}-rank{r}.txt")] for r in range(4)}
    n = len(rows[0])
    out = {}
    for bwd in ("0", "1"):
        idx = [i for i in range(n) if rows[0][i][0] == bwd]
        skew = [abs(float(rows[a][i][2]) - float(rows[b][i][2])) * 1e3 for i in idx for a, b in ((0, 1), (2, 3))]
        waits = [(float(rows[r][i][3]) - float(rows[r][i][2])) * 1e3 for i in idx for r in range(4)]
        out[bwd] = (len(idx), st.median(skew), st.mean(skew), sum(waits) / 4)
    print(tag, " | ".join(f"{'bwd' if k=='1' else 'fwd'}: calls {v[0]}, entry skew median {v[1]:.1f} mean {v[2]:.1f} ms, wait total/rank {v[3]:.0f} ms" for k, v in out.items()))
