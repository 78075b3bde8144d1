"""Why mpstream took 1.18x the tutorial pipeline's time at split 60 on the H100.

Both halves on cuda:0, the tutorial's sizes. Times both models round-robin,
counts the caching allocator's device allocations over the timed calls, and
profiles one train() of each (kernel time on the GPU, runtime calls on the
host). Writes split60.txt and one profiler table per model into the folder
given as the first argument.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mpstream import bench

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda:0")
cfg = bench.FULL
names = ("tutorial pipeline", "mpstream")
models = {}
for name in names:
    torch.manual_seed(0)
    models[name] = bench.make_model(name, dev, dev, cfg, 60)
    for _ in range(3):
        bench.train_once(models[name], cfg, (dev, dev))
times: dict[str, list[float]] = {n: [] for n in names}
allocs = dict.fromkeys(names, 0)
for _ in range(8):
    for name in names:
        before = torch.cuda.memory_stats(dev)["num_device_alloc"]
        times[name].append(bench.train_once(models[name], cfg, (dev, dev)))
        allocs[name] += torch.cuda.memory_stats(dev)["num_device_alloc"] - before
lines = []
for name in names:
    lines.append(
        f"{name}: median {statistics.median(times[name]) * 1e3:.1f} ms per train(), "
        f"min {min(times[name]) * 1e3:.1f}; device allocations over 8 calls: {allocs[name]}"
    )
for name in names:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        bench.train_once(models[name], cfg, (dev, dev))
    events = prof.key_averages()
    # mpstream's record_function ranges carry device time too: leave them out.
    kernel_ms = (
        sum(e.self_device_time_total for e in events if not e.key.startswith("mpstream/")) / 1e3
    )
    runtime = {
        e.key: (e.count, e.self_cpu_time_total / 1e3)
        for e in events
        if e.key.startswith("cuda") or e.key.startswith("cudnn")
    }
    top = sorted(runtime.items(), key=lambda kv: -kv[1][1])[:8]
    lines.append(f"{name}: kernels {kernel_ms:.1f} ms on the GPU in one train(); runtime calls:")
    lines += [f"    {k}: {c} calls, {ms:.1f} ms" for k, (c, ms) in top]
    slug = name.replace(" ", "_")
    (out / f"{slug}.txt").write_text(
        events.table(sort_by="self_device_time_total", row_limit=25)
        + "\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=25)
    )
text = "\n".join(lines)
print(text)
(out / "split60.txt").write_text(text + "\n")
