"""A minimal PyTorch DDP job (gloo, CPU): launched unmodified by ddprun and by torchrun, it must
reach the same final weights. Uses the launcher's store through TORCHELASTIC_USE_AGENT_STORE."""
import os, torch, torch.distributed as dist
import torch.nn as nn
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(10, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1234)
X = torch.randn(64, 10, generator=g); Y = X.sum(1, keepdim=True)
for step in range(20):
    xb = X[rank::world]; yb = Y[rank::world]
    loss = ((model(xb) - yb) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
w = torch.cat([p.detach().flatten() for p in model.parameters()])
if rank == 0:
    print("FINAL", " ".join(f"{v:.6f}" for v in w.tolist()), flush=True)
dist.destroy_process_group()
