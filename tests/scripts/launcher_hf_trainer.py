"""An ordinary HuggingFace `transformers.Trainer` script: a tiny GPT-2 built from a config
(no download), synthetic data, no monitoring code.

`--api CONFIG` attaches the TrainerMon API from a TrainerCallback at the start of training,
for comparison with what `msmon run` gives for the unmodified script.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    """Arithmetic token sequences: deterministic, learnable, no tokenizer needed."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = (i * 3 + torch.arange(9) * (1 + i % 5)) % 64
        return {"input_ids": ids, "labels": ids.clone()}


class AttachMonitor(TrainerCallback):
    def __init__(self, config: str) -> None:
        self.config = config

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from msmon import TrainerMon

        TrainerMon(self.config).set_monitor(model, optimizer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", required=True)
    parser.add_argument("--api")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    callbacks = [AttachMonitor(args.api)] if args.api else []
    Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=callbacks).train()


if __name__ == "__main__":
    main()
