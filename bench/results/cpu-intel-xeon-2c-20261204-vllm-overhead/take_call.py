# throwaway: the mover's per-call validation (_take_call) and description for 256 vLLM blocks
import time, statistics, cProfile, pstats, io, hashlib
import torch, numpy as np, kvmove
from tests.support.memory_store import MemoryStore
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.worker import block_mover, block_pages
layers, blocks = 16, 513
full = torch.zeros(layers, blocks, 8, 16, 128, dtype=torch.bfloat16)
src = [full[i] for i in range(layers)]
views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], blocks)
store = MemoryStore()
mover = block_mover(views, store, staging_slots=256, path="staged")
keys = ["bench-llama@tp_rank:0@pcp0@dcp0@pp_rank:0@" + hashlib.sha256(bytes([i % 256, i // 256])).hexdigest() for i in range(256)]
ids = list(range(511, 0, -2))[:256]
def take(): mover._take_call(keys, block_pages(ids), None, gathering=True)
for _ in range(50): take()
t = []
for _ in range(300):
    t0 = time.perf_counter(); take(); t.append(time.perf_counter() - t0)
print(f"_take_call warm: {statistics.median(t)*1e6:.1f} us")
pr = cProfile.Profile(); pr.enable()
for _ in range(300): take()
pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15); print(s.getvalue()[:3500])
