import sys, torch
sys.path[:0] = [".", "proto"]
from kernels.attention import triton as tri
dev = "cuda"; g = torch.Generator().manual_seed(0)
hq, hkv, d, w, rows = 9, 3, 64, 16, 4200
k = torch.randn(4, rows, hkv, d, generator=g).to(dev, torch.bfloat16); v = torch.randn_like(k)
q = torch.randn(1, w, hq, d, generator=g).to(dev, torch.bfloat16)
par = [-1] + [max(0, i - 1 - (i % 3 == 0)) for i in range(1, w)]
bits = []
for i, p in enumerate(par):
    bits.append((1 << i) | (bits[p] if p >= 0 else 0))
anc = torch.tensor([bits], device=dev); slots = torch.tensor([1], device=dev)
for chunk, splits in ((256, 17), (256, 1), (256, 4), (128, 33), (64, 65)):
    tri.CHUNK = chunk
    row = []
    for L in (100, 250, 1000, 3000):
        lengths = torch.tensor([L], device=dev)
        f = lambda: tri.pool_attention(q, k, v, slots, lengths, anc, 0.125, False, splits=splits)
        for _ in range(5): f()
        torch.cuda.synchronize()
        gph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gph):
            for _ in range(30): f()
        ts = []
        for _ in range(7):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); gph.replay(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) / 30 * 1e3)
        ts.sort(); row.append(f"L={L}: {ts[3]:.1f}")
    print(f"chunk {chunk:3d} splits {splits:2d}: " + "  ".join(row) + " us")
