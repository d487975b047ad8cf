"""A megatron-core GPTModel training script with no monitoring code (TP=PP=1, bf16, one GPU per
rank), for the prepared GPU check of msmon's Megatron adapters (run_megatron_gpu.sh).

`--optimizer distributed` builds a DistributedOptimizer, `--optimizer float16` a
Float16OptimizerWithFloat16Params, both through `get_megatron_optimizer`. After every step it saves
the truth from the whole tensors Megatron holds: fp32 main weights before/after the step, the
reduced `main_grad`, the Adam moments, and the losses.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, BATCH = 128, 32, 4


def stats(t: torch.Tensor) -> dict[str, float]:
    x = t.detach().double().flatten()
    return {
        "norm": float(x.norm()),
        "min": float(x.min()),
        "max": float(x.max()),
        "mean": float(x.mean()),
        "nans": float(torch.isnan(x).sum()),
        "infs": float(torch.isinf(x).sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=["distributed", "float16"], required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(123)
    torch.manual_seed(123)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ).cuda()
    distributed = args.optimizer == "distributed"
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0, use_distributed_optimizer=distributed),
        [model],
    )
    params = dict(model.named_parameters())
    inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer

    def main_param(p):  # the whole fp32 main copy: with one data-parallel rank a shard is the whole param
        return getattr(p, "main_param", None) if getattr(p, "main_param", None) is not None else p

    gen = torch.Generator(device="cuda").manual_seed(7)
    position_ids = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, -1)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, device="cuda", dtype=torch.bool), diagonal=1)
    truth = {"optimizer": type(inner).__name__, "steps": [], "losses": []}
    for _ in range(args.steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device="cuda", generator=gen)
        loss = model(tokens[:, :-1], position_ids, mask, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        model.finish_grad_sync()
        record = {
            "grad_reduced": {n: stats(p.main_grad) for n, p in params.items()},
            "param_origin": {n: stats(main_param(p)) for n, p in params.items()},
        }
        optimizer.step()
        record["param_updated"] = {n: stats(main_param(p)) for n, p in params.items()}
        for key in ("exp_avg", "exp_avg_sq"):
            record[key] = {n: stats(inner.optimizer.state[main_param(p)][key]) for n, p in params.items()}
        truth["steps"].append(record)
        truth["losses"].append(loss.item())
    with open(os.path.join(args.out, f"truth_rank{dist.get_rank()}.json"), "w") as fh:
        json.dump(truth, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
