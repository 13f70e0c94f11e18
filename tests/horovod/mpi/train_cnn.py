"""A small CNN trained with hvd.DistributedOptimizer on synthetic data (fixed seeds).

Usage (under mpirun): train_cnn.py OUT.pt [steps] [keep-grads]
Every rank checks that it ends with rank 0's parameters; rank 0 saves them, the per-step loss
averaged over ranks, and how many storages the gradients live in after the last step.
keep-grads zeroes them in place (model.zero_grad(set_to_none=False)).
"""
import sys

import torch
import torch.nn.functional as F
import horovod.torch as hvd

hvd.init()
torch.manual_seed(1234)          # same initial model everywhere (broadcast below anyway)
torch.set_num_threads(1)
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
set_to_none = sys.argv[3:4] != ["keep-grads"]

model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(2),
    torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

# A learnable synthetic task: the label is which quadrant holds the bright patch.
g = torch.Generator().manual_seed(100 + hvd.rank())
losses = []
for step in range(steps):
    labels = torch.randint(0, 4, (16,), generator=g)
    images = torch.randn(16, 3, 16, 16, generator=g) * 0.3
    for i, label in enumerate(labels.tolist()):
        r, c = divmod(label, 2)
        images[i, :, r * 8:(r + 1) * 8, c * 8:(c + 1) * 8] += 1.0
    if set_to_none:
        optimizer.zero_grad()
    else:   # Horovod's zero_grad takes no arguments
        model.zero_grad(set_to_none=False)
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    losses.append(hvd.allreduce(loss.detach(), name="loss").item())

# every rank applied the same reduced gradients: the same parameters, bitwise (BatchNorm's running
# statistics are each rank's own)
final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
agree = hvd.allgather_object(torch.equal(final, hvd.broadcast(final, root_rank=0, name="final_parameters")))
if not all(agree):
    sys.exit(f"rank {hvd.rank()}: the ranks' parameters differ after training: {agree}")
if hvd.rank() == 0:
    torch.save({"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "losses": losses,
                "grad_storages": len({p.grad.untyped_storage().data_ptr() for p in model.parameters()})},
               sys.argv[1])
    print(f"TRAINED first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f}", flush=True)
