"""Where DeepSpeed's stage 0 and Megatron's DDP reduce whole gradients: the `before`/`after`
calls grad_agreement takes the copy and the sums in, on stand-ins with the libraries' layout
(the real runs: tests/e2e/test_deepspeed_e2e.py, tests/e2e/test_megatron_e2e.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from msmon.collectors.grads.agreement import unavailable
from msmon.hooks.deepspeed.reduction import whole_gradient_reduction as deepspeed_reduction
from msmon.hooks.megatron.reduction import whole_gradient_reduction as megatron_reduction


class Engine:
    """DeepSpeedEngine's methods the wrapper reads; `allreduce_gradients` logs its calls."""

    def __init__(self, stage: int, boundary: bool) -> None:
        self.stage, self.boundary, self.log = stage, boundary, []
        self.optimizer = object()

    def zero_optimization_stage(self) -> int:
        return self.stage

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.boundary

    def allreduce_gradients(self, bucket_size: int = 0) -> None:
        self.log.append("reduce")


def test_deepspeed_stage_0_is_followed_at_accumulation_boundaries_only_and_undone():
    engine = Engine(stage=0, boundary=False)
    undo = deepspeed_reduction(
        [engine], object(), lambda params: engine.log.append(("before", params)), lambda: engine.log.append("after")
    )
    assert undo is not None
    engine.allreduce_gradients()  # a micro-step inside the accumulation: stage 0 reduces nothing
    engine.boundary = True
    engine.allreduce_gradients()
    assert engine.log == ["reduce", ("before", None), "reduce", "after"]
    undo()
    engine.allreduce_gradients()
    assert engine.log[-1] == "reduce" and "allreduce_gradients" not in vars(engine)


@pytest.mark.parametrize("optimizer", ["BF16_Optimizer", "DeepSpeedZeroOptimizer"])
def test_deepspeed_zero_stages_and_own_buffers_are_not_followed(optimizer):
    assert deepspeed_reduction([Engine(stage=1, boundary=True)], object(), print, print) is None
    engine = Engine(stage=0, boundary=True)
    own = type(optimizer, (), {})()
    assert deepspeed_reduction([engine], own, print, print) is None


class BucketGroup:
    """_ParamAndGradBucketGroup's layout: finish_grad_sync calls start_grad_sync (no overlap)."""

    def __init__(self, params, log) -> None:
        self.params, self.log = params, log

    def start_grad_sync(self) -> None:
        self.log.append(("reduce", self))

    def finish_grad_sync(self) -> None:
        self.start_grad_sync()


def test_megatron_bucket_groups_are_copied_before_each_sync_and_summed_once_all_have_finished():
    log: list = []
    params = [SimpleNamespace(main_grad=1), SimpleNamespace(main_grad=2), SimpleNamespace(main_grad=3)]
    first, second = BucketGroup(params[:2], log), BucketGroup(params[2:], log)
    chunk = SimpleNamespace(bucket_groups=[first, second], ddp_config=SimpleNamespace(use_distributed_optimizer=False))
    undo = megatron_reduction([chunk], object(), lambda ps: log.append(("before", ps)), lambda: log.append("after"))
    assert undo is not None
    for _ in range(2):  # two steps
        first.start_grad_sync()  # overlap_grad_reduce: started from the backward hooks...
        first.finish_grad_sync()  # ...and started again by finish (not copied twice)
        second.finish_grad_sync()
    step = [
        ("before", [(p, p.main_grad) for p in params[:2]]),
        ("reduce", first),
        ("reduce", first),
        ("before", [(p, p.main_grad) for p in params[2:]]),
        ("reduce", second),
        "after",
    ]
    assert log == step + step
    undo()
    assert "start_grad_sync" not in vars(first) and "finish_grad_sync" not in vars(second)


def test_megatron_distributed_optimizer_is_not_followed():
    chunk = SimpleNamespace(
        bucket_groups=[BucketGroup([], [])], ddp_config=SimpleNamespace(use_distributed_optimizer=True)
    )
    assert megatron_reduction([chunk], object(), print, print) is None
    chunk.ddp_config.use_distributed_optimizer = False
    distributed = type("DistributedOptimizer", (), {})()
    assert megatron_reduction([chunk], SimpleNamespace(chained_optimizers=[distributed]), print, print) is None
    assert megatron_reduction([SimpleNamespace()], object(), print, print) is None  # no Megatron DDP chunk


@pytest.mark.parametrize(
    ("adapter", "said"),
    [
        ("Zero12Adapter", "DeepSpeed ZeRO-1/2 copies each reduced bucket back only into the slices"),
        ("Zero3Adapter", "a rank holds only its shard"),
        ("BF16Adapter", "BF16_Optimizer reduces its own fp32 accumulation buffers"),
        ("DistributedAdapter", "Megatron's distributed optimizer reduce-scatters"),
        ("Fsdp1Adapter", "NO_SHARD is followed only where every unit is NO_SHARD"),
        ("Fsdp2Adapter", "FSDP2 reduce-scatters"),
    ],
)
def test_where_no_rank_holds_the_whole_reduced_gradient_the_reason_names_the_setup(adapter, said):
    assert said in unavailable(True, True, adapter)
    assert unavailable(True, False, "TorchOptimAdapter") is None
