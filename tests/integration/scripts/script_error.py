"""A job-API trainer with a bug that every process meets at the second step it runs (the shape
of DDP's bucket rebuild landing in lent memory): it calls `model.zero_grad()`, which replaces the
retained gradient views, so `opt.step()` raises the runtime's PortingError.  Recovering it in
place would walk the failure forward one step per generation."""
import torch

import leto_runtime as leto

job = leto.init(seed=0, device="cpu")
with job.meta_init():
    model = torch.nn.Linear(8, 8)
model = job.retain(model)
opt = job.adamw(model, lr=1e-3)
for n, step in enumerate(job.steps(8)):
    x = torch.full((4, 8), float(step + 1))
    model(x).square().mean().backward()
    if n == 1:
        model.zero_grad()
    opt.step()
