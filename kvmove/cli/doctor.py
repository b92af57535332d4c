"""``kvmove doctor``: what a user needs to know before filing a bug.

It reports the GPU and driver, torch, Triton, the CUDA binding of the copy engine
(cuda-bindings, of torch's CUDA major), Mooncake (versions and flavours),
``libibverbs``, the memlock limit for pinned memory, whether a tuned kernel table exists for
this GPU, whether the master named by ``MOONCAKE_*`` (or ``--master``) answers, and which KV
caches its transport can move in place (``KVMover(path=...)``). It
exits 1 when something blocks use, naming the fix; 0 otherwise (notes are not problems).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata as metadata
import os
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass

MOONCAKE_DISTS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda",
                  "mooncake-transfer-engine-cuda13")
SETUP = "bash scripts/setup.sh (or pip install kvmove[cpu|cuda12|cuda13])"


@dataclass
class Finding:
    topic: str
    text: str
    level: str = "ok"  # ok | note | problem
    fix: str = ""


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--master", default=None,
                        help="host:port of a Mooncake master to check (default: "
                             "MOONCAKE_MASTER, if set)")
    parser.add_argument("--timeout", type=float, default=3.0,
                        help="seconds to wait for the master's TCP port (default 3)")
    parser.add_argument("--gpu-check", action="store_true",
                        help="what scripts/gpu_check.sh needs: the copy engine's binding is "
                             "required; Mooncake and the master are not checked")
    return parser


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_gpu() -> tuple[list[Finding], str | None]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [Finding("GPU", "no NVIDIA GPU (nvidia-smi not found): kvmove copies with "
                        "the torch backend on the CPU", "note")], None
    try:
        out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [Finding("GPU", f"nvidia-smi failed: {e}", "problem",
                        "check the NVIDIA driver (nvidia-smi must run)")], None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not lines:
        return [Finding("GPU", f"nvidia-smi failed: {out.stderr.strip() or out.stdout.strip()}",
                        "problem", "check the NVIDIA driver (nvidia-smi must run)")], None
    found = [Finding("GPU", f"{i}: {line}") for i, line in enumerate(lines)]
    return found, lines[0].split(",")[0].strip()


def check_torch(gpu_name: str | None) -> list[Finding]:
    try:
        import torch
    except ImportError as e:
        return [Finding("torch", f"not importable: {e}", "problem", f"run {SETUP}")]
    cuda = torch.version.cuda
    flavour = f"CUDA {cuda} build" if cuda else "CPU build"
    found = [Finding("torch", f"{torch.__version__} ({flavour}), CUDA available: "
                     f"{torch.cuda.is_available()}")]
    if gpu_name and not torch.cuda.is_available():
        fix = ("install a CUDA build of torch: bash scripts/setup.sh on this machine"
               if not cuda else "check the driver: torch sees no CUDA device")
        found.append(Finding("torch", "this machine has a GPU but torch cannot use it",
                             "problem", fix))
    return found


def check_triton(gpu_name: str | None) -> list[Finding]:
    try:
        import triton
    except ImportError as e:
        level = "problem" if gpu_name else "note"
        return [Finding("Triton", f"not importable: {e}", level, "pip install triton")]
    return [Finding("Triton", f"{triton.__version__}")]


def check_cuda_bindings(gpu_name: str | None, *, required: bool = False) -> list[Finding]:
    """cuda-bindings, which the copy engine needs (two-hop path, batched copies; pinned
    staging and the direct kernel need no binding). Missing on a GPU machine it is a note,
    or a problem with ``required`` (``scripts/gpu_check.sh``: the check tests the copy
    engine). Where torch sees the GPU, one small copy through it into pinned memory proves
    it works with this driver (a binding of another CUDA major than torch's may)."""
    if gpu_name is None:
        return [Finding("cuda-bindings", "no GPU: not used", "note")]
    try:
        import torch
    except ImportError:
        return []
    major = (torch.version.cuda or "").split(".")[0]
    fix = (f"pip install 'kvmove[cuda{major}]' (or 'cuda-bindings>={major},<{int(major) + 1}')"
           if major else "install a CUDA build of torch first")
    version = _version("cuda-bindings")
    from kvmove.memory import cuda_api  # the one module that touches the bindings

    problem = cuda_api.copy_engine_problem()
    if problem is not None:
        text = (f"{problem}: the copy engine (two-hop path, batched copies) cannot run; "
                "pinned staging and the direct kernel need no binding")
        return [Finding("cuda-bindings", text, "problem" if required else "note", fix)]
    found = [Finding("cuda-bindings", f"{version} (torch's CUDA: {torch.version.cuda})")]
    if version and major and version.split(".")[0] != major:
        found.append(Finding("cuda-bindings", f"{version} is for CUDA {version.split('.')[0]}, "
                             f"torch is built for CUDA {major}: it works only where the "
                             "driver supports both (the copy below tells)", "note", fix))
    if torch.cuda.is_available():
        found += _copy_engine_probe(fix)
    return found


def _copy_engine_probe(fix: str) -> list[Finding]:
    """Pin 64 KiB as the staging is pinned, copy 256 bytes into it through the copy engine at
    its device address, and compare."""
    import torch

    from kvmove.memory import cuda_api
    from kvmove.memory.host_memory import HostMemory

    try:
        memory = HostMemory(1 << 16, pin=True)
        try:
            src = torch.arange(256, dtype=torch.int64, device="cuda").to(torch.uint8)
            torch.cuda.synchronize()
            cuda_api.memcpy_async(memory.device_address + 64, src.data_ptr(), 256,
                                  torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            right = torch.equal(memory.tensor[64:320], src.cpu())
            uva = memory.device_address == memory.address
        finally:
            memory.close()
    except Exception as e:
        return [Finding("copy engine", f"a copy into pinned memory failed: {e}", "problem", fix)]
    if not right:
        return [Finding("copy engine", "a copy into pinned memory wrote wrong bytes", "problem",
                        "report this: the device address of pinned memory is wrong here")]
    batch = cuda_api.has_memcpy_batch()
    return [Finding("copy engine", "a copy into pinned memory is right ("
                    + ("device address = host address (UVA)" if uva else
                       "device address from cudaHostGetDevicePointer") + "); "
                    + ("cuMemcpyBatchAsync available" if batch
                       else "no cuMemcpyBatchAsync (driver < 12.8): one copy per span"),
                    "ok" if batch else "note")]


def check_mooncake() -> list[Finding]:
    dists = [(d, v) for d in MOONCAKE_DISTS if (v := _version(d))]
    found = []
    if not dists:
        return [Finding("Mooncake", "no Mooncake wheel installed", "problem", f"run {SETUP}")]
    if len(dists) > 1:
        found.append(Finding("Mooncake", f"several wheels installed: {dists}", "problem",
                             "keep one: pip uninstall the others, then reinstall it"))
    dist, version = dists[0]
    flavour = {"mooncake-transfer-engine-non-cuda": "CPU", "mooncake-transfer-engine": "CUDA 12",
               "mooncake-transfer-engine-cuda13": "CUDA 13"}[dist]
    found.append(Finding("Mooncake", f"{dist} {version} ({flavour})"))
    try:
        import mooncake.store  # noqa: F401
    except Exception as e:  # ImportError, or OSError from a missing library
        found.append(Finding("Mooncake", f"import mooncake.store fails: {e}", "problem",
                             "see libibverbs below; on a CUDA wheel without a driver use "
                             "mooncake-transfer-engine-non-cuda"))
    from kvmove.errors import StoreError
    from kvmove.store.embedded_master import find_master_binary

    try:
        found.append(Finding("Mooncake", f"mooncake_master: {find_master_binary()}"))
    except StoreError as e:
        found.append(Finding("Mooncake", str(e), "problem", f"run {SETUP}"))
    return found


def check_ibverbs() -> list[Finding]:
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return [Finding("libibverbs", "libibverbs.so.1 not found (Mooncake's wheels need it)",
                        "problem", "apt-get install -y libibverbs1 (rdma-core on RHEL)")]
    return [Finding("libibverbs", "libibverbs.so.1 loads")]


def check_memlock(gpu_name: str | None) -> list[Finding]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def show(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else f"{v / 2**20:.0f} MiB"

    text = f"memlock limit {show(soft)} (hard {show(hard)})"
    if soft != resource.RLIM_INFINITY and soft < (1 << 30) and gpu_name:
        return [Finding("memlock", text + ": RDMA registration of pinned staging larger "
                        "than this fails", "note",
                        "ulimit -l unlimited (or memlock in /etc/security/limits.conf; "
                        "--ulimit memlock=-1 for docker)")]
    return [Finding("memlock", text)]


def check_tuned(gpu_name: str | None) -> list[Finding]:
    if gpu_name is None:
        return [Finding("tuned table", "no GPU: the Triton kernels are not used", "note")]
    try:
        from kvmove.rows.launch_config import cache_path
    except Exception as e:
        return [Finding("tuned table", f"cannot look: {e}", "note")]
    user = cache_path(gpu_name)
    if user.exists():
        return [Finding("tuned table", f"for {gpu_name}: {user}")]
    return [Finding("tuned table", f"none for {gpu_name}: default launch configs", "note",
                    "kvmove tune (a few minutes) writes one")]


def check_master(address: str | None, timeout: float) -> list[Finding]:
    from kvmove.store.config import StoreConfig
    from kvmove.store.embedded_master import tcp_reachable

    try:
        if address is not None:
            config = StoreConfig(master_address=address)
        elif os.environ.get("MOONCAKE_MASTER"):
            config = StoreConfig.from_env()
        else:
            return [Finding("master", "MOONCAKE_MASTER is not set: only embedded masters "
                            "(MooncakeStore.embedded(), kvmove demo) will be used", "note",
                            "for a cluster: kvmove master, then export the line it prints")]
    except ValueError as e:
        return [Finding("master", str(e), "problem", "fix the value (host:port)")]
    host, _, port = config.master_address.rpartition(":")
    if tcp_reachable(host.strip("[]"), int(port), timeout):
        return [Finding("master", f"{config.master_address} accepts connections "
                        f"({config.protocol}, metadata {config.metadata_server}, "
                        f"{config.replicas} replica(s))")]
    return [Finding("master", f"{config.master_address} does not accept connections "
                    f"within {timeout:g}s", "problem",
                    "start it (kvmove master --host ...) or fix MOONCAKE_MASTER")]


def check_in_place(address: str | None, gpu_name: str | None) -> list[Finding]:
    """Which KV caches the transport lets a mover move in place (the store reading and
    writing the KV rows, no staging copy): host memory always, device memory only over a
    transport that reads it. What ``path="auto"`` picks for a cache is measured when the
    mover is built and logged (``kvmove.mover.path_choice``: "KVMover path: ...")."""
    import torch

    from kvmove.objects.in_place import rows_reachable
    from kvmove.store.config import StoreConfig

    try:
        config = (StoreConfig(master_address=address) if address is not None
                  else StoreConfig.from_env() if os.environ.get("MOONCAKE_MASTER") else None)
    except ValueError:
        config = None  # the master finding says what is wrong
    protocol = config.protocol if config is not None else os.environ.get(
        "MOONCAKE_PROTOCOL", "tcp")
    gpu = rows_reachable(torch.device("cuda", 0), protocol)
    text = (f"over {protocol}: KV caches in host memory can move in place; "
            + ("GPU caches too (GPUDirect RDMA; not verified by kvmove's tests)" if gpu is None
               else "GPU caches move through staging (the transport does not read device "
                    "memory)"))
    text += "; path='auto' measures per cache and logs 'KVMover path: ...'"
    level = "note" if gpu_name and gpu is not None else "ok"
    fix = "a transport that reads device memory: MOONCAKE_PROTOCOL=rdma" if level == "note" \
        else ""
    return [Finding("in place", text, level, fix)]


def collect(args) -> list[Finding]:
    gpu, gpu_name = check_gpu()
    found = gpu + check_torch(gpu_name) + check_triton(gpu_name)
    found += check_cuda_bindings(gpu_name, required=args.gpu_check)
    if args.gpu_check:  # the GPU tests use an in-memory store: no Mooncake needed
        return found + check_memlock(gpu_name)
    found += check_ibverbs() + check_mooncake() + check_memlock(gpu_name)
    found += check_tuned(gpu_name)
    found += check_master(args.master, args.timeout)
    found += check_in_place(args.master, gpu_name)
    return found


def run_main(args) -> int:
    found = collect(args)
    marks = {"ok": "ok     ", "note": "note   ", "problem": "PROBLEM"}
    print(f"kvmove doctor (Python {sys.version.split()[0]}, {sys.executable})")
    for f in found:
        print(f"{marks[f.level]} {f.topic:<12} {f.text}")
        if f.fix and f.level != "ok":
            print(f"{'':20}fix: {f.fix}")
    problems = [f for f in found if f.level == "problem"]
    if problems:
        print(f"{len(problems)} problem(s) block use; fix them first")
        return 1
    print("nothing blocks use")
    return 0
