import json, sys, glob, random, statistics as st
# usage: summ.py DIR TAG  -> files DIR/{before,after}_TAG_r*.json
d, tag = sys.argv[1], sys.argv[2]
def load(v):
    out = []
    for f in sorted(glob.glob(f"{d}/{v}_{tag}_r*.json"), key=lambda s: int(s.rsplit('_r',1)[1].split('.')[0])):
        j = json.load(open(f))
        runs = {r['gpus']: r for r in j['runs']}
        n = max(runs)
        out.append(dict(t1=runs[1]['step_ms_median'], tn=runs[n]['step_ms_median'],
                        ov=runs[n].get('overhead_us_per_device'), loss=runs[n]['final_loss'],
                        loss1=runs[1]['final_loss']))
    return out
b, a = load('before'), load('after')
assert len(a) == len(b) and a
def boot(xs, reps=10000, seed=1):
    rnd = random.Random(seed); m = []
    for _ in range(reps):
        m.append(st.median([rnd.choice(xs) for _ in xs]))
    m.sort(); return st.median(xs), m[int(0.025*reps)], m[int(0.975*reps)]
print(f"{tag}: {len(a)} rounds")
for key in ('t1', 'tn', 'ov'):
    bs = [x[key] for x in b]; as_ = [x[key] for x in a]
    r = [y / x for x, y in zip(bs, as_)]
    med, lo, hi = boot(r)
    print(f"  {key}: before median {st.median(bs):.3f} after {st.median(as_):.3f}  after/before {med:.2f} [{lo:.2f}, {hi:.2f}]  before {sorted(round(v,3) for v in bs)} after {sorted(round(v,3) for v in as_)}")
print("  final loss (N=1, N) before", b[0]['loss1'], b[0]['loss'], "after", a[0]['loss1'], a[0]['loss'])
