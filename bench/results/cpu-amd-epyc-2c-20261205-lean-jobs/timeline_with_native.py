# throwaway: PYTHONPATH=. .venv-vllm/bin/python bench/results/cpu-amd-epyc-2c-20261205-lean-jobs/timeline_with_native.py
# ../cpu-amd-epyc-2c-20261205-watched-calls/timeline_in_bench.py with each row's native time printed too: that
# script's text with three lines changed, run as it is
import pathlib
here = pathlib.Path(__file__).resolve().parent
src = (here.parent / "cpu-amd-epyc-2c-20261205-watched-calls" / "timeline_in_bench.py").read_text()
changes = [
    ("'''OVER = {}\n", "'''OVER = {}\nNATS = {}\n"),
    ('    OVER.setdefault(_CUR[0], []).append(dt - _NAT["t"])\n',
     '    OVER.setdefault(_CUR[0], []).append(dt - _NAT["t"]); '
     'NATS.setdefault(_CUR[0], []).append(_NAT["t"])\n'),
    ('median {statistics.median(v_)*1e6:7.0f} us")',
     'median {statistics.median(v_)*1e6:7.0f} us native {statistics.median(NATS[k_])*1e6:7.0f} us")'),
]
for old, new in changes:
    assert src.count(old) == 1, old
    src = src.replace(old, new)
exec(compile(src, "timeline_in_bench.py (with native times)", "exec"), {"__name__": "__main__"})
