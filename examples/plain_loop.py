"""A plain PyTorch loop with GradMonitor: python examples/plain_loop.py [--logdir DIR]."""

import argparse

import torch
from torch import nn

from gradwatch import GradMonitor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--logdir", default="runs/plain-loop")
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    teacher = torch.randn(32, 4) / 32**0.5
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    with GradMonitor(model, logdir=args.logdir, flush_every=50) as monitor:
        for step in range(args.steps):
            x = torch.randn(64, 32)
            loss = nn.functional.mse_loss(model(x), torch.tanh(x @ teacher))
            loss.backward()
            monitor.step()  # after backward, before zero_grad
            optimizer.step()
            optimizer.zero_grad()
    print(f"{len(monitor.alerts)} alert(s); tensorboard --logdir {args.logdir}")


if __name__ == "__main__":
    main()
