# throwaway: host µs of the small operations a GPU call makes
import time, torch
dev = torch.device("cuda")
a = torch.arange(16).reshape(16, 1); b = torch.arange(16)
blk = torch.zeros(4096, dtype=torch.int32, device=dev)
def t(name, f, n=2000):
    for _ in range(200): f()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): f()
    dt = (time.perf_counter() - t0) / n * 1e6; torch.cuda.synchronize()
    print(f"{name:40s} {dt:7.2f} us")
def up1():
    s = torch.empty(a.shape, dtype=a.dtype, pin_memory=True); s.copy_(a); return s.to(dev, non_blocking=True)
def up2():
    s = torch.empty(32, dtype=torch.int64, pin_memory=True); s[:16].copy_(a.reshape(-1)); s[16:].copy_(b)
    d = s.to(dev, non_blocking=True); return d[:16], d[16:]
def up2cat():
    s = torch.empty(32, dtype=torch.int64, pin_memory=True); torch.cat((a.reshape(-1), b), out=s)
    d = s.to(dev, non_blocking=True); return d[:16], d[16:]
i = iter(range(10**9))
t("torch.zeros(1, int32, cuda)", lambda: torch.zeros(1, dtype=torch.int32, device=dev))
t("slice of a zeroed block", lambda: blk[next(i) % 4096:][:1])
t("narrow of a zeroed block", lambda: blk.narrow(0, next(i) % 4096, 1))
t("one upload (pinned snapshot)", up1)
t("two uploads", lambda: (up1(), up1()))
t("one upload of two, two copy_", up2)
t("one upload of two, cat", up2cat)
t("with torch.cuda.device(dev)", lambda: torch.cuda.device(dev).__enter__())
def guard():
    with torch.cuda.device(dev): pass
t("with torch.cuda.device(dev): pass", guard)
t("torch.cuda.current_stream()", lambda: torch.cuda.current_stream(dev))
t("tensor.contiguous() (already)", lambda: b.contiguous())
