"""An ordinary HF `Trainer` script run with `--deepspeed` (a tiny GPT-2 built from a config, no
download, synthetic data, no monitoring code), on CPU ranks.

A TrainerCallback saves, after every optimizer step, what DeepSpeed itself assembles for each
parameter: the full fp32 weight (`safe_get_full_fp32_param`) and Adam moments
(`safe_get_full_optimizer_state`), the truth the monitor's output is checked against.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from launcher_hf_trainer import Tokens  # noqa: E402  (the same synthetic data as the plain HF script)

from conftest import reference_stats  # noqa: E402


class SaveTruth(TrainerCallback):
    def __init__(self, model: torch.nn.Module, path: str) -> None:
        self.params = dict(model.named_parameters())
        self.path = path
        self.steps: list[dict] = []

    def on_step_end(self, args, state, control, **kwargs):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        record = {"param_updated": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for name, p in self.params.items():
            record["param_updated"][name] = reference_stats(safe_get_full_fp32_param(p).float())
            for key in ("exp_avg", "exp_avg_sq"):
                record[key][name] = reference_stats(safe_get_full_optimizer_state(p, key).float())
        self.steps.append(record)

    def on_train_end(self, args, state, control, **kwargs):
        with open(self.path, "w") as fh:
            json.dump({"steps": self.steps}, fh)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", required=True)
    parser.add_argument("--stage", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = GPT2LMHeadModel(config)
    deepspeed = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
    }
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
        deepspeed=deepspeed,
    )
    rank = int(os.environ.get("RANK", "0"))
    truth = SaveTruth(model, os.path.join(args.output, f"truth_rank{rank}.json"))
    Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=[truth]).train()


if __name__ == "__main__":
    main()
