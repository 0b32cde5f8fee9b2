"""A plain PyTorch loop sending gradwatch's statistics to Weights & Biases (offline here).

    WANDB_MODE=offline python examples/plain_loop_wandb.py [--dir DIR] [--steps N]

gradwatch flushes every `flush_every` steps, so each flush delivers the values of steps
that are already past. W&B's own step only grows, so the values are logged with their
training step as a metric and charted against it (`define_metric(..., step_metric=)`);
W&B keeps them, in order, whatever its internal step is.
"""

import argparse

import torch
from torch import nn

from gradwatch import GradMonitor


def main() -> None:
    import wandb

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="runs/wandb")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    run = wandb.init(project="gradwatch-example", dir=args.dir, mode="offline")
    run.define_metric("train/step")
    run.define_metric("gradwatch/*", step_metric="train/step")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    teacher = torch.randn(32, 4) / 32**0.5

    def to_wandb(metrics: dict[str, float], step: int) -> None:
        run.log({**metrics, "train/step": step})

    with GradMonitor(model, flush_every=50, optimizer=optimizer, metrics_callback=to_wandb) as monitor:
        for _ in range(args.steps):
            x = torch.randn(64, 32)
            nn.functional.mse_loss(model(x), torch.tanh(x @ teacher)).backward()
            monitor.step()
            optimizer.step()
            optimizer.zero_grad()
    run.finish()
    print(f"{len(monitor.alerts)} alert(s); offline W&B run in {args.dir} (wandb sync to upload)")


if __name__ == "__main__":
    main()
