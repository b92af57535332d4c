# throwaway: PYTHONPATH=. .venv-vllm/bin/python bench/results/cpu-amd-epyc-2c-20261205-lean-jobs/bench_vllm_no_main_steal.py --repeat 15 --json <file>
# bench_vllm with a job never stolen by the main thread (the mover's worker runs it; the native call watched there)
import sys, threading
import kvmove.transfer as T
orig = T.StealableJob.steal
def steal(self):
    if threading.current_thread() is threading.main_thread():
        return
    orig(self)
T.StealableJob.steal = steal
from bench.bench_vllm import main
sys.exit(main(sys.argv[1:]))
