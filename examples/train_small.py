"""Train a small model a few steps, checkpoint it, load it into a fresh model and optimizer, and check
that every tensor matches and that training continues exactly as an uninterrupted run would.

Run: python examples/train_small.py [checkpoint_dir]
"""

from __future__ import annotations

import sys
import tempfile

import torch

import arraycheckpoint as acp


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(64, 32, generator=gen), torch.randn(64, 8, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="acp-example-") + "/step_5"
    model, opt = build(seed=0)
    train(model, opt, steps=5, seed=1)

    fut = acp.save_async(path, {"model": model, "optimizer": opt, "extra_state": {"step": 5}}, step=5)
    fut.staged.result()  # snapshot taken: training could go on here while the write runs
    fut.result()  # committed
    print(f"saved step 5 to {path}")

    fresh, fresh_opt = build(seed=123)
    extra: dict = {}
    acp.load(path, {"model": fresh, "optimizer": fresh_opt, "extra_state": extra})
    same_model = all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())
    )
    state_a, state_b = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    same_opt = all(torch.equal(state_a[i][k], state_b[i][k]) for i in state_a for k in state_a[i])
    continued = train(model, opt, 3, seed=2) == train(fresh, fresh_opt, 3, seed=2)
    print(f"model states match: {same_model}; optimizer states match: {same_opt}; step: {extra['step']}")
    print(f"3 more training steps match an uninterrupted run: {continued}")
    if not (same_model and same_opt and continued):
        sys.exit(1)


if __name__ == "__main__":
    main()
