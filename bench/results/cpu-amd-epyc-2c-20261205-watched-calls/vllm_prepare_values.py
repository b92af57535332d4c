# throwaway: PYTHONPATH=. .venv-vllm/bin/python bench/results/cpu-amd-epyc-2c-20261205-watched-calls/vllm_prepare_values.py
# hot cost of vLLM's own descriptor build for the bench_vllm geometry (RankLocalStoreLayout.
# prepare_values, 256 blocks x 16 layers), and of the connector's block_pages
import bench  # noqa
import time, statistics
from bench.bench_vllm import llama_like_cache
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata, RankLocalStoreLayout
from kvmove.integrations.vllm.worker import block_pages
n, bs, L = 256, 16, 16
src = llama_like_cache(L, 2*n+1, 8, bs, 64)
vllm = RankLocalStoreLayout(KeyMetadata("bench-llama", 0, 0, 0, 0), bs, bs)
vllm.register_kv_caches(src, 2*n+1)
chunks = [(i * bs, (i + 1) * bs) for i in range(n)]
load_ids = list(range(2 * n - 2, -1, -2))[:n]
ts, tb = [], []
for r in range(50):
    t0 = time.perf_counter(); vllm.prepare_values(chunks, load_ids, [0] * n); ts.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); block_pages(load_ids); tb.append(time.perf_counter() - t0)
print(f"prepare_values {statistics.median(ts)*1e6:.0f} us; block_pages {statistics.median(tb)*1e6:.0f} us")
