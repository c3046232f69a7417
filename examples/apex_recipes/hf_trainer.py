"""transformers' Trainer with its apex backend, unchanged, on ampinit.

    python -m ampinit.run examples/apex_recipes/hf_trainer.py [--opt-level O2] [--poison-step 5]

transformers 4.42-4.57 (the last with an apex backend that runs off CUDA) looks for apex when it
is imported and then calls ``amp.initialize``, ``amp.scale_loss`` and, to clip, ``amp.master_params``
from apex.  ``python -m ampinit.run`` installs ampinit under apex's names before this script
imports transformers; nothing here knows about ampinit until the report at the end.  The task
is a tiny BERT learning a parity label; ``--poison-step`` makes one loss inf to show the skip.
Prints one JSON line: the losses, the skipped steps, the opt level ampinit ran.
"""

import argparse
import json

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    """32 short sequences; the label is the parity of the first token."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(1, 50, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids[0] % 2}


class PoisonedTrainer(Trainer):
    """Makes the loss of one step inf (as a real fp16 overflow would): that step is skipped."""

    poison_step = -1

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        if self.state.global_step == self.poison_step:
            loss = (loss[0] * float("inf"), *loss[1:]) if return_outputs else loss * float("inf")
        return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--poison-step", type=int, default=-1)
    parser.add_argument("--optim", default="adamw_torch", help="adamw_torch, or adamw_apex_fused (apex's FusedAdam)")
    parser.add_argument("--output-dir", default="examples/out/hf_trainer")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16)
    training = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=8,
                                 learning_rate=3e-3, fp16=True, half_precision_backend="apex",
                                 fp16_opt_level=args.opt_level, optim=args.optim, use_cpu=True, report_to=[],
                                 save_strategy="no", logging_steps=1, max_grad_norm=1.0, seed=0)
    trainer = PoisonedTrainer(model=BertForSequenceClassification(config), args=training, train_dataset=Tokens())
    trainer.poison_step = args.poison_step
    trainer.train()

    from apex import amp  # the alias: ampinit
    handle = amp.handle_of(trainer.model)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(json.dumps({"use_apex": trainer.use_apex, "opt_level": handle.config.opt_level,
                      "skipped_steps": handle.skipped_steps, "first_loss": losses[0], "last_loss": losses[-1],
                      "finite": all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())}))


if __name__ == "__main__":
    main()
