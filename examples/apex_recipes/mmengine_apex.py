"""mmengine's ``ApexOptimWrapper``, unchanged, on ampinit.

    python -m ampinit.run examples/apex_recipes/mmengine_apex.py [--opt-level O2]

mmengine imports ``apex.amp`` when ``mmengine.optim`` is imported and, inside
``optim_context``, calls ``amp.initialize`` (with all of apex's keyword arguments) unless the
optimizer already has apex's ``_amp_stash``; ``update_params`` runs ``amp.scale_loss`` and the
optimizer's step; its state dict carries ``amp.state_dict()`` under ``"apex_amp"``.  Prints one
JSON line: losses, skipped steps, and whether the state dict round trip kept the loss scale.
"""

import argparse
import json

import mmengine.model  # noqa: F401  (ApexOptimWrapper.optim_context uses mmengine.model.wrappers)
import torch
from mmengine.optim import ApexOptimWrapper
from torch import nn


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--poison-step", type=int, default=-1)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    wrapper = ApexOptimWrapper(optimizer=torch.optim.SGD(model.parameters(), lr=0.2), opt_level=args.opt_level,
                               loss_scale="dynamic")
    data = torch.Generator().manual_seed(1)
    weights = torch.randn(8, generator=data)
    losses = []
    for step in range(args.steps):
        x = torch.randn(32, 8, generator=data)
        y = (x @ weights > 0).long()
        with wrapper.optim_context(model):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        if step == args.poison_step:
            loss = loss * float("inf")
        wrapper.update_params(loss)
        losses.append(loss.item())
    state = wrapper.state_dict()
    saved_scale = state["apex_amp"]["loss_scaler0"]["loss_scale"]
    wrapper.load_state_dict(state)  # mmengine pops "apex_amp" and hands it to amp.load_state_dict

    from apex import amp  # the alias: ampinit
    handle = amp.handle_of(model)
    print(json.dumps({"opt_level": handle.config.opt_level, "skipped_steps": handle.skipped_steps,
                      "first_loss": losses[0], "last_loss": losses[-1], "amp_state_saved": True,
                      "scale_kept": saved_scale == handle.loss_scale()}))


if __name__ == "__main__":
    main()
