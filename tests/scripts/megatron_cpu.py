"""Megatron-core optimizers on 2 CPU ranks (gloo), monitored with the TrainerMon API.

Megatron refuses to build its optimizers and its DDP without CUDA (megatron-core 0.16.1 puts
small tensors on 'cuda' in their constructors), so this script builds the *real* optimizer
classes (`FP32Optimizer`, `Float16OptimizerWithFloat16Params`, `DistributedOptimizer`,
`ChainedOptimizer`) with `object.__new__` and sets exactly the attributes their constructors
set, on CPU tensors; their own `step()`, `prepare_grads()` and `step_with_ready_grads()` run.
Megatron's DDP is the stand-in `MegatronDDP`: the attribute layout of
`megatron.core.distributed.DistributedDataParallel` 0.16.1 that the optimizers and msmon use
(`module`, `buffers` of `_ParamAndGradBuffer`s whose bucket holds `param_data`/`grad_data`,
`bucket_groups` with `params` and `start_grad_sync()`), parameters and `main_grad` being views
into the buffers, gradients accumulated into `main_grad` by a hook and averaged over the
data-parallel group at the grad sync, parameters all-gathered after the step.

Saved per rank as the truth: the full fp32 weights before/after each step, the reduced and
rank-local `main_grad`, the full Adam moments (shards gathered whole, which msmon never does),
and the gradient agreement (cos, |local|/|reduced|, float64) of all `main_grad`s concatenated,
before and after the grad sync.

With `--clip`, `clip_grad` is 1.0 and the loss is scaled up so that Megatron's `step()` clips
every step. Megatron's norm and scaling functions put scratch tensors on 'cuda'; the same
computation on the CPU takes their place (`cpu_grad_norm`, `cpu_clip`), and Megatron's own
`step()` still calls them where it does, between `prepare_grads` and the inner step. The truth
for `grad_reduced` is then what the inner torch optimizers receive, read by this script's own
step pre-hook on each (consumed_grads.py).

With `--loss-scale S` (float16 case) the optimizer has Megatron's `ConstantGradScaler` (its
scale on the CPU), and every micro-step's backward runs through Megatron's own
`schedules.backward_step` with `grad_scale_func = optimizer.scale_loss`, as Megatron's schedules
call it: even micro-steps by `torch.autograd.backward`, odd ones by `custom_backward`
(`deallocate_pipeline_outputs`). Megatron's `step()` unscales the main gradients. The losses
saved are the script's unscaled ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from consumed_grads import ConsumedGradients  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.optimizer import OptimizerConfig  # noqa: E402
from megatron.core.optimizer import optimizer as megatron_optimizer  # noqa: E402
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range  # noqa: E402
from megatron.core.optimizer.grad_scaler import ConstantGradScaler  # noqa: E402
from megatron.core.optimizer.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,  # noqa: E402
)
from megatron.core.pipeline_parallel import schedules  # noqa: E402

from conftest import MLP, reference_stats  # noqa: E402
from msmon import TrainerMon  # noqa: E402

STEPS, MICRO = 3, 2


class BucketGroup:
    """_ParamAndGradBucketGroup's layout: `params`, `buckets`, `start_grad_sync()`."""

    def __init__(self, buffer: Buffer, group) -> None:
        self.buckets = buffer.buckets
        self.params = set(buffer.params)
        self.group = group

    def start_grad_sync(self, force_all_reduce: bool = False) -> None:
        for bucket in self.buckets:  # averaged over data parallelism (all-reduce: same values as reduce-scatter)
            bucket.grad_data.div_(dist.get_world_size(self.group))
            dist.all_reduce(bucket.grad_data, group=self.group)

    def finish_grad_sync(self) -> None:
        self.start_grad_sync()


class Buffer:
    """_ParamAndGradBuffer with one bucket: params and main_grads are views into flat buffers."""

    def __init__(self, params: list[torch.nn.Parameter], dp: int) -> None:
        self.params = params
        numel = sum(p.numel() for p in params)
        numel += (-numel) % dp  # padded to a multiple of the data-parallel size, as Megatron pads
        dtype = params[0].dtype
        self.param_dtype, self.grad_dtype = dtype, torch.float32
        bucket = SimpleNamespace(
            param_data=torch.zeros(numel, dtype=dtype),
            grad_data=torch.zeros(numel),
            params_list=params,
            params=set(params),
        )
        self.buckets = [bucket]
        self.offsets = {}
        offset = 0
        for p in params:
            n = p.numel()
            bucket.param_data[offset : offset + n].copy_(p.data.view(-1))
            p.data = bucket.param_data[offset : offset + n].view_as(p)
            p.main_grad = bucket.grad_data[offset : offset + n].view(p.shape)
            self.offsets[p] = offset
            offset += n


class MegatronDDP(torch.nn.Module):
    """megatron.core.distributed.DistributedDataParallel's layout, for one model chunk."""

    def __init__(self, module: torch.nn.Module, ddp_config, dp_group) -> None:
        super().__init__()
        self.module = module
        self.ddp_config = ddp_config
        self.dp_group = dp_group
        self.buffers = [Buffer([p for p in module.parameters()], dist.get_world_size(dp_group))]
        self.bucket_groups = [BucketGroup(b, dp_group) for b in self.buffers]
        self.expert_parallel_bucket_groups = []
        for p in module.parameters():  # Megatron's backward post-hook: accumulate into main_grad
            p.register_post_accumulate_grad_hook(_into_main_grad)

    def forward(self, x):
        return self.module(x)

    def finish_grad_sync(self) -> None:
        for bucket_group in self.bucket_groups:
            bucket_group.finish_grad_sync()

    def start_param_sync(self, force_dispatch: bool = False) -> None:
        """All-gather: every rank contributes the range it owns (the others are zero here)."""
        rank, world = dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)
        for buffer in self.buffers:
            data = buffer.buckets[0].param_data
            size = data.numel() // world
            mine = data[rank * size : (rank + 1) * size].clone()
            data.zero_()
            data[rank * size : (rank + 1) * size].copy_(mine)
            full = data.float()
            dist.all_reduce(full, group=self.dp_group)
            data.copy_(full)

    def zero_grad_buffer(self) -> None:
        for buffer in self.buffers:
            buffer.buckets[0].grad_data.zero_()


def _into_main_grad(p: torch.nn.Parameter) -> None:
    p.main_grad.add_(p.grad.float())
    p.grad = None


def optimizer_config(clip: bool = False) -> OptimizerConfig:
    return OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, clip_grad=1.0 if clip else 0.0)


def cpu_grad_norm(grads_for_norm, norm_type=2, grad_stats_parallel_group=None) -> float:
    """get_grad_norm_fp32's L2 norm: squares summed locally, then over the grad-stats group."""
    total = torch.zeros((), dtype=torch.float32)
    for grad in grads_for_norm:
        total += grad.float().pow(2).sum()
    dist.all_reduce(total, group=grad_stats_parallel_group)
    return float(total) ** 0.5


def cpu_clip(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    """clip_grad_by_total_norm_fp32: every `.grad` scaled in place when the norm is too large."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(coeff)


def cpu_grad_scaler(opt, scale: float) -> None:
    """MixedPrecisionOptimizer.__init__ with a ConstantGradScaler, its tensors on the CPU."""
    scaler = object.__new__(ConstantGradScaler)
    scaler._scale = torch.tensor([scale])
    opt.grad_scaler, opt.found_inf = scaler, torch.tensor([0.0])


def megatron_backward(loss: torch.Tensor, optimizer, micro: int) -> None:
    """One micro-step's backward as Megatron's schedules run it on the last pipeline stage."""
    config = SimpleNamespace(
        timers=None, grad_scale_func=optimizer.scale_loss, deallocate_pipeline_outputs=micro % 2 == 1
    )
    schedules.backward_step(None, loss, None, ModelType.encoder_or_decoder, config)


def fp32_optimizer(params, config) -> FP32Optimizer:
    opt = object.__new__(FP32Optimizer)
    opt.optimizer, opt.config, opt.init_state_fn = torch.optim.Adam(params, lr=config.lr), config, lambda x: None
    opt._scale, opt.is_stub_optimizer = torch.tensor([1.0]), False
    return opt


def _mixed_precision(opt, params, config) -> None:
    """MegatronOptimizer.__init__ and MixedPrecisionOptimizer.__init__ (bf16, no grad scaler)."""
    opt.optimizer, opt.config, opt.init_state_fn = torch.optim.Adam(params, lr=config.lr), config, lambda x: None
    opt.grad_scaler, opt._dummy_overflow_buf, opt._scale_one = None, None, torch.tensor([1.0])


def float16_optimizer(params, config) -> Float16OptimizerWithFloat16Params:
    opt = object.__new__(Float16OptimizerWithFloat16Params)
    _mixed_precision(opt, params, config)
    opt.float16_groups, opt.fp32_from_float16_groups, opt.fp32_from_fp32_groups = [], [], []
    for group in opt.optimizer.param_groups:  # the constructor's loop, minus its CUDA type check
        float16, main, fp32 = [], [], []
        for i, p in enumerate(group["params"]):
            if p.dtype in (torch.bfloat16, torch.float16):
                main_param = p.detach().clone().float()
                group["params"][i] = main_param
                p.main_param = main_param
                float16.append(p)
                main.append(main_param)
            else:
                fp32.append(p)
        opt.float16_groups.append(float16)
        opt.fp32_from_float16_groups.append(main)
        opt.fp32_from_fp32_groups.append(fp32)
    opt.is_stub_optimizer = False
    return opt


def distributed_optimizer(chunks: list[MegatronDDP], config, dp_group) -> DistributedOptimizer:
    """DistributedOptimizer.__init__'s attributes: each rank owns a contiguous range of every
    bucket; main params, moments and reduced grads exist for that range only."""
    opt = object.__new__(DistributedOptimizer)
    rank, world = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    opt.model_chunks, opt.ddp_config = chunks, chunks[0].ddp_config
    opt.buffers = [b for c in chunks for b in c.buffers]
    opt.data_parallel_group = dp_group
    opt.gbuf_ranges, opt.model_param_gbuf_map = [], {}
    model_float16, shard_fp32_from_float16, shard_float16 = [], [], []
    for index, buffer in enumerate(opt.buffers):
        size = buffer.buckets[0].param_data.numel() // world
        start, end = rank * size, (rank + 1) * size
        param_map = {}
        for p in buffer.params:
            offset = buffer.offsets[p]
            lo, hi = max(offset, start), min(offset + p.numel(), end)
            if lo >= hi:
                continue  # no part of p in this rank's range
            param_map[p] = {
                "param": Range(lo - offset, hi - offset),
                "gbuf_world_in_bucket": Range(lo, hi),
                "gbuf_world": Range(lo, hi),
                "gbuf_local": Range(lo - start, hi - start),
            }
            opt.model_param_gbuf_map[p] = (index, (buffer.param_dtype, buffer.grad_dtype), 0)
            shard = p.detach().view(-1)[lo - offset : hi - offset]
            main = shard.clone().float()
            p.main_param, p.main_param_sharded = main, True
            model_float16.append(p)
            shard_float16.append(shard)
            shard_fp32_from_float16.append(main)
        opt.gbuf_ranges.append({(buffer.param_dtype, buffer.grad_dtype): [{"param_map": param_map}]})
    _mixed_precision(opt, shard_fp32_from_float16 or [torch.zeros(0)], config)
    opt.model_float16_groups, opt.model_fp32_groups = [model_float16], [[]]
    opt.shard_float16_groups, opt.shard_fp32_groups = [shard_float16], [[]]
    opt.shard_fp32_from_float16_groups = [shard_fp32_from_float16]
    opt.is_stub_optimizer = False
    return opt


def gather_full(p: torch.Tensor, local: torch.Tensor | None, span: tuple[int, int] | None, group) -> torch.Tensor:
    """The whole tensor from the ranks' ranges (for the truth only)."""
    full = torch.zeros(p.numel(), dtype=torch.float64)
    if local is not None:
        full[span[0] : span[1]] = local.double()
    dist.all_reduce(full, group=group)
    return full


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["fp32", "float16", "distributed", "chained", "tp"], required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--clip", action="store_true", help="clip_grad=1.0, with gradients that need it")
    parser.add_argument("--loss-scale", type=float, default=0.0, help="a ConstantGradScaler (float16 case)")
    args = parser.parse_args()
    if args.clip:
        megatron_optimizer.get_grad_norm_fp32 = cpu_grad_norm
        megatron_optimizer.clip_grad_by_total_norm_fp32 = cpu_clip
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2 if args.case == "tp" else 1)
    dp_group = parallel_state.get_data_parallel_group()
    torch.manual_seed(0)
    dtype = torch.float32 if args.case == "fp32" else torch.bfloat16
    n_chunks = 2 if args.case in ("distributed", "chained") else 1
    modules = [MLP().to(dtype) for _ in range(n_chunks)]
    if args.case == "tp":
        modules[0].fc1.weight.tensor_model_parallel = True  # split across TP ranks: each writes its own
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=args.case in ("distributed", "chained"))
    chunks = [MegatronDDP(m, ddp_config, dp_group) for m in modules]
    config = optimizer_config(args.clip)
    if args.case == "fp32":
        optimizer = fp32_optimizer(chunks[0].parameters(), config)
    elif args.case in ("float16", "tp"):
        optimizer = float16_optimizer(list(chunks[0].parameters()), config)
        if args.loss_scale:
            cpu_grad_scaler(optimizer, args.loss_scale)
    elif args.case == "distributed":
        optimizer = distributed_optimizer(chunks, config, dp_group)
    else:  # a distributed optimizer for chunk 0, a float16 one for chunk 1, chained
        optimizer = ChainedOptimizer(
            [
                distributed_optimizer(chunks[:1], config, dp_group),
                float16_optimizer(list(chunks[1].parameters()), config),
            ]
        )
        if not args.clip:  # its fp32 norm kernel needs CUDA; without clipping the value is unused
            optimizer.get_grad_norm = lambda: 0.0

    monitor = TrainerMon(args.config)
    monitor.set_monitor(chunks, optimizer)

    named = [(c, n, p) for c, chunk in enumerate(modules) for n, p in chunk.named_parameters()]
    sharded = {}  # id(p) -> (shard main, span) for distributed-optimizer params
    masters = {}  # id(p) -> the whole fp32 master
    parts = optimizer.chained_optimizers if args.case == "chained" else [optimizer]
    for part in parts:
        if isinstance(part, DistributedOptimizer):
            for p, main in zip(part.model_float16_groups[0], part.shard_fp32_from_float16_groups[0]):
                span = part._get_model_param_range_map(p)["param"]
                sharded[id(p)] = (main, (span.start, span.end))
        elif isinstance(part, Float16OptimizerWithFloat16Params):
            masters.update({id(p): m for p, m in zip(part.float16_groups[0], part.fp32_from_float16_groups[0])})
    all_sharded = {
        id(p) for part in parts if isinstance(part, DistributedOptimizer) for b in part.buffers for p in b.params
    }
    inner_of = {
        id(p): part.optimizer for part in parts for p in (p for b in getattr(part, "buffers", []) for p in b.params)
    }

    def weight(p):
        if id(p) in all_sharded:
            main, span = sharded.get(id(p), (None, None))
            return gather_full(p, main, span, dp_group)
        return masters.get(id(p), p).detach()

    def moment(p, key):
        if id(p) in all_sharded:
            main, span = sharded.get(id(p), (None, None))
            local = inner_of[id(p)].state[main][key] if main is not None else None
            return gather_full(p, local, span, dp_group)
        part = next(
            q
            for q in parts
            if id(p) in {id(x) for g in q.optimizer.param_groups for x in g["params"]}
            or id(p) in {id(x) for g in getattr(q, "float16_groups", []) for x in g}
        )
        return part.optimizer.state[masters.get(id(p), p)][key]

    def stats(fn) -> dict:
        return {f"{c}:{n}": reference_stats(fn(p).float()) for c, n, p in named}

    captures = [ConsumedGradients(part.optimizer, isinstance(part, DistributedOptimizer)) for part in parts]
    scale = 50.0 if args.clip else 1.0  # gradients of norm well above clip_grad

    gen = torch.Generator().manual_seed(100 + rank)
    truth = {"steps": [], "losses": [], "numel": {f"{c}:{n}": p.numel() for c, n, p in named}}
    truth["loss_scale"] = float(optimizer.get_loss_scale())  # what scale_loss multiplies by
    for _ in range(STEPS):
        for micro in range(MICRO):
            x = torch.randn(2, 8, generator=gen).to(dtype)
            loss = sum(chunk(x).float().pow(2).mean() for chunk in chunks) * scale
            truth["losses"].append(loss.item())
            if args.loss_scale:
                megatron_backward(loss, optimizer, micro)
            else:
                loss.backward()
        record = {"grad_unreduced": stats(lambda p: p.main_grad)}
        local = torch.cat([p.main_grad.reshape(-1).double() for _, _, p in named])
        for chunk in chunks:
            chunk.finish_grad_sync()
        record["grad_reduced"] = stats(lambda p: p.main_grad)
        reduced = torch.cat([p.main_grad.reshape(-1).double() for _, _, p in named])
        # the gradient agreement of this rank's main_grad before and after the grad sync (all of them)
        record["agreement"] = [
            float(local @ reduced / (local.norm() * reduced.norm())),
            float(local.norm() / reduced.norm()),
        ]
        record["param_origin"] = stats(weight)
        _, unclipped_norm, _ = optimizer.step()
        record["consumed"] = dict(ConsumedGradients.take(captures), unclipped_norm=unclipped_norm)
        record["param_updated"] = stats(weight)
        record["exp_avg"] = stats(lambda p: moment(p, "exp_avg"))
        record["exp_avg_sq"] = stats(lambda p: moment(p, "exp_avg_sq"))
        truth["steps"].append(record)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
    monitor.close()
    with open(os.path.join(args.out, f"truth_rank{rank}.json"), "w") as fh:
        json.dump(truth, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
