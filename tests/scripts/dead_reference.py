"""A reference that does not train: its loss is multiplied by 0, so every gradient is zero and no
parameter moves. `ttrace check` must refuse to judge anything against it."""

import torch
from torch import nn

import ttrace_core as ttrace

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
session = ttrace.attach(model, optimizer)
with session.step(0):
    loss = model(torch.randn(4, 8)).sum() * 0.0  # the bug under test: a loss that carries no gradient
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
session.close()
