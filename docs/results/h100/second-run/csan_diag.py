"""Reproduces two CUDA-sanitizer (CSAN) behaviours seen on the H100 run; output in csan_diag.log."""
import os, subprocess, sys
A = r'''
import torch
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
ids = set()
for i in range(20):
    with torch.cuda.stream(s1 if i % 2 else s2):
        t = torch.empty(0, device="cuda"); ids.add(id(t)); del t
print("A done, distinct ids", len(ids))
'''
B = r'''
import sys, torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
early = sys.argv[1] == "1"
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU()).cuda()
x = torch.randn(4, 8, device="cuda", requires_grad=True)
with set_checkpoint_early_stop(early):
    y = checkpoint(m, x, use_reentrant=False)
y.sum().backward()
torch.cuda.synchronize()
print("B done, early_stop", early)
'''
env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
for name, code, args in (("A empty tensors on two streams", A, []), ("B checkpoint early stop", B, ["1"]),
                         ("B checkpoint no early stop", B, ["0"])):
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120)
    print(f"=== {name}: exit {r.returncode}; CSAN reports {r.stderr.count('CSAN detected')}; "
          f"SystemError {'SystemError' in r.stderr}; hook failure {'trace hook execution failed' in r.stderr}")
    print(r.stdout.strip()); print(r.stderr.strip()[-1500:])
