"""pool_attention tree mode, old kernel vs this tree's, SmolLM2 shapes (hq 9, hkv 3, d 64, W 16), bf16."""
import sys, importlib.util, torch
sys.path[:0] = [".", "proto"]
from kernels.attention import triton as new
spec = importlib.util.spec_from_file_location("attn_old", ".peer/mb/attn_old.py"); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
dev = "cuda"; g = torch.Generator().manual_seed(0)
hq, hkv, d, w, rows = 9, 3, 64, 16, 4200
k = torch.randn(4, rows, hkv, d, generator=g).to(dev, torch.bfloat16); v = torch.randn_like(k)
q = torch.randn(1, w, hq, d, generator=g).to(dev, torch.bfloat16)
par = [-1] + [max(0, i - 1 - (i % 3 == 0)) for i in range(1, w)]
bits = []
for i, p in enumerate(par):
    bits.append((1 << i) | (bits[p] if p >= 0 else 0))
anc = torch.tensor([bits], device=dev)
slots = torch.tensor([1], device=dev)
for L in (100, 250, 1000, 3000):
    lengths = torch.tensor([L], device=dev)
    outs = {}
    for name, mod in (("old", old), ("new", new)):
        f = lambda: mod.pool_attention(q, k, v, slots, lengths, anc, 0.125, False, splits=17)
        for _ in range(5): outs[name] = f()
        torch.cuda.synchronize()
        gph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gph):
            for _ in range(30): f()
        ts = []
        for _ in range(7):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); gph.replay(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) / 30 * 1e3)
        ts.sort(); print(f"L={L:5d} {name}: {ts[3]:.2f} us per call (median of 7 x 30 in a graph)")
    print("   equal bits:", torch.equal(outs["old"], outs["new"]))
