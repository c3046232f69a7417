"""What O1/O4's FP32 outputs cost: a language-model head's logits cast to FP32 so that a loss
computed outside the model runs in FP32 (as apex's patched loss functions did).

Times forward + cross-entropy + backward of a small transformer LM, per step (median), at O1
(or O4 with ``--bf16``) with the default ``cast_model_outputs=torch.float32`` against
``cast_model_outputs=torch.float16`` (apex's O1 outputs, where the loss would run in fp16), and
against torch.autocast with the loss inside the autocast region (which computes cross-entropy
in FP32 by its own policy) -- all in the same run.  Also prints the extra memory the FP32
logits hold (4 bytes instead of 2 per logit, alive until the backward of the cast).

    python benchmarks/bench_o1_outputs.py [--vocab 8192 --seq 128 --batch 8 --repeats 10]
"""

import argparse
import platform
import statistics
import time

import torch
from torch import nn

import ampinit as amp


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int = 128, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        block = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(self.blocks(self.embed(ids)))


def timed(step, repeats):
    step()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--bf16", action="store_true", help="O4 (bf16 autocast) instead of O1")
    args = parser.parse_args()
    level, low = ("O4", torch.bfloat16) if args.bf16 else ("O1", torch.float16)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    targets = ids.roll(-1, dims=1)

    def ampinit_step(outputs_dtype):
        torch.manual_seed(0)
        model = amp.initialize(TinyLM(args.vocab), opt_level=level, cast_model_outputs=outputs_dtype, verbosity=0)
        loss_fn = nn.CrossEntropyLoss()

        def step():
            model.zero_grad()
            logits = model(ids)
            loss_fn(logits.reshape(-1, args.vocab), targets.reshape(-1)).backward()
        return step, model(ids).dtype

    def autocast_step():
        torch.manual_seed(0)
        model = TinyLM(args.vocab)
        loss_fn = nn.CrossEntropyLoss()

        def step():
            model.zero_grad()
            with torch.autocast("cpu", dtype=low):
                loss = loss_fn(model(ids).reshape(-1, args.vocab), targets.reshape(-1))
            loss.backward()
        return step

    fp32_step, fp32_dtype = ampinit_step(torch.float32)
    low_step, low_dtype = ampinit_step(low)
    low_name = str(low).replace("torch.", "")
    rows = [(f"ampinit {level}, FP32 outputs (default)", timed(fp32_step, args.repeats)),
            (f"ampinit {level}, {low_name} outputs (apex's O1 dtype)", timed(low_step, args.repeats)),
            ("torch.autocast, loss inside autocast", timed(autocast_step(), args.repeats))]
    logits = args.batch * args.seq * args.vocab
    print(f"torch {torch.__version__}, ampinit {amp.__version__}, python {platform.python_version()}, "
          f"{platform.machine()}, {torch.get_num_threads()} threads, CPU")
    print(f"TinyLM: vocab {args.vocab}, width 128, 2 layers; batch {args.batch} x seq {args.seq}; "
          f"median of {args.repeats}; outputs {fp32_dtype} vs {low_dtype}\n")
    print("| forward + cross-entropy + backward | ms | vs FP32 outputs |")
    print("|---|---:|---:|")
    base = rows[0][1]
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} | {ms / base:.2f}x |")
    print(f"\nFP32 logits hold {logits * 4 / 2**20:.1f} MiB where {str(low).replace('torch.', '')} "
          f"logits hold {logits * 2 / 2**20:.1f} MiB (+{logits * 2 / 2**20:.1f} MiB until the cast's backward); "
          "torch.autocast's cross-entropy makes the same FP32 copy inside the loss.")


if __name__ == "__main__":
    main()
