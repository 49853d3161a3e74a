"""The target's verify_batch host time on the CPU box with the device work stubbed out (session 26):
the tiny llama, batch 1, an AR step (one node, no feature layers) and a 16-node chain whose rows go
to the feature ring (its store stubbed out too: on CUDA it is one launch after the replay), median
microseconds of 1,300 steps after 200, each case twice, alternating. Run from the repo root:

    env -u PYTHONPATH .venv/bin/python benchmarks/gpu/step/run26-stepgraph/verify_host_cpu.py

Output on the 2-core CPU box (verify_host_cpu.txt): width, ring, microseconds.
"""
import random, time, sys, statistics
sys.path[:0]=['.','proto']
from fixtures.tiny_models import write_tiny_llama
from target_service.batched_engine import BatchedEngine
from target_service.engine import Sampling
from target_service.models.llama import LlamaModel
from runtime import graphs
from runtime.feature_ring import FeatureRing
write_tiny_llama('/tmp/tiny.gguf', seed=3)
model = LlamaModel.from_gguf('/tmp/tiny.gguf')
graphs.StepGraph.run = lambda self, tail=None, head=None: (head() if head else None, tail() if tail else None)
FeatureRing.store = lambda self, *a, **k: None
def bench(width, ring):
    layers=[0,1]
    eng = BatchedEngine(model, max_sessions=8, max_context=4096, max_tree_width=16, max_tree_depth=16, feature_layers=layers, pad_to_buckets=True, ring_rows=64)
    s = Sampling.checked(0.0, 0, 0.0, 0)
    rng = random.Random(1)
    root = eng.prefill("a", [rng.randrange(300) for _ in range(10)], s, layers if ring else []).first_token
    if ring: eng.ring_features(["a"])
    toks=[[rng.randrange(300) for _ in range(width-1)] for _ in range(64)]
    ts=[]
    for k in range(1500):
        items=[("a",[root]+toks[k%64],[-1]+list(range(width-1)))]
        t=time.perf_counter(); r=eng.verify_batch(items)[0]; ts.append(time.perf_counter()-t)
        root=r.bonus_token
    return statistics.median(ts[200:])*1e6
for w,ring in ((1,False),(16,True),(1,False),(16,True)):
    print(w, ring, round(bench(w,ring),1))
