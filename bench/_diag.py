import sys, time, torch
sys.path.insert(0, ".")
from bench.engine_gpu import build_model
from kvlab.engine import RunSpec, generate
from kvlab.policies import make_policy
from kvlab.budget import Budget
import kvlab.cache as cache_mod
L = build_model(4)
ids = torch.randint(0, 1000, (1, 4096), device="cuda")
def t(name, mode, n=24, chunk=1024):
    b = None if name == "full" else Budget(keep=0.1)
    r = generate(L, ids, RunSpec(make_policy(name), b, mode=mode, chunk=chunk if mode == "streaming" else None, max_new_tokens=n, stop_token_ids=()))
    return round(1000 * r.decode_seconds / (n - 1), 2)
cases = [("full", "prefill"), ("full", "streaming"), ("streaming", "prefill"), ("streaming", "streaming"), ("h2o", "streaming"), ("snapkv", "streaming")]
for label in ["contiguous", "no-cudnn", "cuda-graph-free-sync-check"]:
    if label == "no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    for name, mode in cases[:4] if label != "contiguous" else cases:
        t(name, mode, 4)
        print(label, name, mode, [t(name, mode) for _ in range(3)], flush=True)
    if label == "no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(True)
        break
from torch.profiler import profile, ProfilerActivity
for name, mode in [("full", "prefill"), ("streaming", "streaming")]:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t(name, mode, 12)
    print(name, mode)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
