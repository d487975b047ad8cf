"""DeepSpeed ZeRO on 2 CPU ranks (gloo) whose monitors read a config edit at different steps.

Each rank's monitor reads its own copy of the config (`$MSMON_CONFIG`, set before
`import msmon.auto`, the documented way for a script started by plain torchrun), and rank r
replaces its copy (an editor's atomic save) during step `--edit-at[r]`: as if the file system
showed the edit to one node steps before the other. The copy is made afresh from `before.json`
when the job starts, so a rerun of the job (the tests rerun one that gloo aborted at teardown)
starts from the config before the edit again, not from the edit the first run left behind.
The script saves the statistics of the whole tensors DeepSpeed itself assembles
(`safe_get_full_*`) at every step, as the truth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

RANK = int(os.environ.get("RANK", "0"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--edit-at", type=int, nargs=2, required=True)
    args = parser.parse_args()
    config_path = os.path.join(args.work, f"monitor_rank{RANK}.json")
    with open(os.path.join(args.work, "before.json"), encoding="utf-8") as fh:
        before = fh.read()
    with open(config_path + ".tmp", "w", encoding="utf-8") as fh:
        fh.write(before)
    os.replace(config_path + ".tmp", config_path)
    os.environ["MSMON_CONFIG"] = config_path
    import torch

    import msmon.auto  # noqa: F401

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    sys.path.insert(0, os.path.dirname(__file__))
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
    from ds_train import ds_config

    from conftest import MLP, reference_stats

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = MLP()
    grad_acc = 2
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(args.stage, "fp32", grad_acc)
    )
    params = dict(model.named_parameters())

    def stats(getter) -> dict:
        return {name: reference_stats(getter(p).float()) for name, p in params.items()}

    with open(os.path.join(args.work, "edited.json"), encoding="utf-8") as fh:
        edited = fh.read()
    gen = torch.Generator().manual_seed(100 + RANK)
    steps = []
    for step in range(args.steps):
        if step == args.edit_at[RANK]:
            with open(config_path + ".tmp", "w", encoding="utf-8") as fh:
                fh.write(edited)
            os.replace(config_path + ".tmp", config_path)
        for micro in range(grad_acc):
            engine.backward(engine(torch.randn(2, 8, generator=gen)).pow(2).mean())
            if micro == grad_acc - 1:
                record = {"grad_reduced": stats(safe_get_full_grad), "param_origin": stats(safe_get_full_fp32_param)}
            engine.step()
        record.update(
            param_updated=stats(safe_get_full_fp32_param),
            exp_avg=stats(lambda p: safe_get_full_optimizer_state(p, "exp_avg")),
            exp_avg_sq=stats(lambda p: safe_get_full_optimizer_state(p, "exp_avg_sq")),
        )
        steps.append(record)
    with open(os.path.join(args.work, f"truth_rank{RANK}.json"), "w", encoding="utf-8") as fh:
        json.dump({"steps": steps}, fh)


if __name__ == "__main__":
    main()
