"""DeepSpeed's ``"amp"`` mode (apex's amp inside DeepSpeed), unchanged, on ampinit, on the CPU.

    python -m ampinit.run examples/apex_recipes/deepspeed_amp.py [--opt-level O2] [--accumulate 2]

DeepSpeed up to 0.19.7 accepts an ``"amp"`` section and hands it to apex's ``amp.initialize``,
then backpropagates through ``amp.scale_loss(loss, optimizer, delay_unscale=...)`` (delayed on
the micro-batches before an accumulation boundary) and clips ``amp.master_params``.  It imports
apex when it is imported, so ``python -m ampinit.run`` installs the alias first.  0.18.2 is the
newest release whose amp path runs: 0.18.3-0.19.7 fail on every backward with amp enabled (a
DeepSpeed bug, apex or not) and 0.19.8 removed the section.  One process over gloo; the CPU
shared-memory all-reduce op DeepSpeed would compile on first use (minutes) is not needed for one
process and is skipped.  On the CPU, DeepSpeed's gradient all-reduce takes only FP32 gradients,
so O2/O3 (fp16 models) need a GPU there; O1 runs anywhere.  Prints one JSON line.
"""

import argparse
import json
import os
import sys

for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                       LOCAL_SIZE="1", DS_ACCELERATOR="cpu").items():
    os.environ.setdefault(key, value)

import deepspeed.comm.torch  # noqa: E402

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # one process: no shared-memory op to build

import deepspeed  # noqa: E402
import torch  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step (delay_unscale)")
    parser.add_argument("--poison-step", type=int, default=-1)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": args.accumulate,
              "gradient_clipping": 1.0, "steps_per_print": 1_000_000,
              "amp": {"enabled": True, "opt_level": args.opt_level}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    data = torch.Generator().manual_seed(1)
    weights = torch.randn(8, generator=data)
    losses = []
    for step in range(args.steps):
        for _ in range(args.accumulate):
            x = torch.randn(16, 8, generator=data)
            y = (x @ weights > 0).long()
            loss = torch.nn.functional.cross_entropy(engine(x), y)
            if step == args.poison_step:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()  # an optimizer step at each accumulation boundary
        losses.append(loss.item())

    from apex import amp  # the alias: ampinit
    handle = amp.handle_of(engine.module)
    print(json.dumps({"opt_level": handle.config.opt_level, "skipped_steps": handle.skipped_steps,
                      "first_loss": losses[0], "last_loss": losses[-1],
                      "finite": all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())}))


if __name__ == "__main__":
    main()
