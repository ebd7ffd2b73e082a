import sys, time, torch
sys.path.insert(0, ".")
from bench.engine_gpu import build_model
from kvlab.engine import RunSpec, generate
from kvlab.policies import make_policy
from kvlab.budget import Budget
L = build_model(2)
ids = torch.randint(0, 1000, (1, 2048), device="cuda")
def t(name, mode, n=24):
    b = None if name == "full" else Budget(keep=0.1)
    r = generate(L, ids, RunSpec(make_policy(name), b, mode=mode, chunk=1024 if mode == "streaming" else None, max_new_tokens=n, stop_token_ids=()))
    return round(1000 * r.decode_seconds / (n - 1), 2)
for label, setup in [("default", lambda: None), ("no-cudnn", lambda: torch.backends.cuda.enable_cudnn_sdp(False))]:
    setup()
    for name, mode in [("full", "prefill"), ("full", "streaming"), ("streaming", "prefill"), ("streaming", "streaming")]:
        t(name, mode, 4)
        print(label, name, mode, [t(name, mode) for _ in range(3)], flush=True)
torch.backends.cuda.enable_cudnn_sdp(True)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t("full", "prefill", 12)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
