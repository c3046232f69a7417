"""Run by test_checkpoint.py in fresh processes.

``train DIR CASES``: for each case, the uninterrupted run (dumped) and the first half (checkpointed).
``resume DIR CASES``: for each case, a fresh initialize that loads the checkpoint in apex's
order (model, optimizer, amp) and trains the second half (dumped).
"""
import json
import os
import sys

import torch

import ampinit as amp
from conftest import make_setup, train_step

POISONED = {3}  # an overflow before the cut
CUT, TOTAL = 6, 12


def _dump(model, opt, path):
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "masters": [p.detach().clone() for p in amp.master_params(opt)],
                "model": model.state_dict(), "amp": opt.amp.state_dict()}, path)


def _train(model, opt, start, stop):
    for step in range(start, stop):
        train_step(model, opt, step, poison=step in POISONED)


def main(mode, directory, cases_json):
    torch.set_num_threads(1)
    for name, (level, kwargs) in json.loads(cases_json).items():
        base = os.path.join(directory, name)
        if mode == "train":
            model, opt = make_setup(level, **kwargs)
            _train(model, opt, 0, TOTAL)
            _dump(model, opt, base + ".full")
            model, opt = make_setup(level, **kwargs)
            _train(model, opt, 0, CUT)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "amp": amp.state_dict()}, base + ".ckpt")
        else:
            model, opt = make_setup(level, **kwargs)
            checkpoint = torch.load(base + ".ckpt")
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["optimizer"])
            amp.load_state_dict(checkpoint["amp"])
            _train(model, opt, CUT, TOTAL)
            _dump(model, opt, base + ".resumed")


if __name__ == "__main__":
    main(*sys.argv[1:])
