"""Activations and their gradients (xy_distribution): values, naming, micro-steps, edge cases."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from conftest import ALL_OPS, MLP, assert_row_matches, rank_dir, read_csv_rows, reference_stats
from msmon import TrainerMon


def rows_by_key(directory, category):
    return {(int(r["step"]), int(r["micro_step"]), r["name"]): r for r in read_csv_rows(directory, category)}


def monitored(write_config, model, cfg, grad_acc=1):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    base = {"xy_distribution": True, "format": "csv", "ops": ALL_OPS}
    mon = TrainerMon(write_config({**base, **cfg}))
    mon.set_monitor(model, optimizer, grad_acc_steps=grad_acc)
    return mon, optimizer


def test_activation_values_equal_independent_statistics_with_inplace_relu(write_config, output_dir):
    torch.manual_seed(0)
    model = MLP()
    mon, optimizer = monitored(write_config, model, {"all_xy": True})
    x = torch.randn(6, 8)
    model(x).square().mean().backward()
    optimizer.step()
    mon.close()

    # the same computation, by hand, on a copy of the weights as they were
    torch.manual_seed(0)
    ref = MLP()
    xr = x.clone().requires_grad_(True)
    h = ref.fc1(xr)
    h.retain_grad()
    a = torch.relu(h)
    a.retain_grad()
    out = ref.fc2(a)
    out.retain_grad()
    out.square().mean().backward()

    out_dir = rank_dir(output_dir)
    actv = rows_by_key(out_dir, "actv")
    expected = {"fc1.input": x, "fc1.output": h, "act.input": h, "act.output": a, "fc2.input": a, "fc2.output": out}
    for name, tensor in expected.items():
        assert_row_matches(actv[(0, 0, name)], reference_stats(tensor))
    grads = rows_by_key(out_dir, "actv_grad")
    expected_grads = {"fc2.output": out.grad, "fc2.input": a.grad, "act.output": a.grad, "fc1.output": h.grad}
    for name, tensor in expected_grads.items():
        assert_row_matches(grads[(0, 0, name)], reference_stats(tensor))
    # the model input does not require grad: no gradient row, never a NaN row
    assert (0, 0, "fc1.input") not in grads


class Pair(torch.nn.Module):
    def forward(self, x):
        return x * 2, x - 1


class Consumer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        a, b = self.pair(self.lin(x))
        return (a * b).sum()


def test_tuple_specs_select_the_named_element(write_config, output_dir):
    model = Consumer()
    mon, optimizer = monitored(
        write_config,
        model,
        {"targets": {"pair": {"output": "tuple[2]:1", "output_grad": "tuple[2]:0", "input": "tensor"}}},
    )
    x = torch.randn(3, 4)
    y = model.lin(x).detach()
    model(x).backward()
    optimizer.step()
    mon.close()
    out_dir = rank_dir(output_dir)
    actv = rows_by_key(out_dir, "actv")
    assert set(actv) == {(0, 0, "pair.input"), (0, 0, "pair.output")}
    assert_row_matches(actv[(0, 0, "pair.output")], reference_stats(y - 1))
    grads = rows_by_key(out_dir, "actv_grad")
    assert (0, 0, "pair.output") in grads and (0, 0, "pair.output_0") not in grads
    assert_row_matches(grads[(0, 0, "pair.output")], reference_stats(y - 1))  # d(a*b)/da = b


def test_several_outputs_are_named_output_i(write_config, output_dir):
    model = Consumer()
    mon, optimizer = monitored(write_config, model, {"targets": {"pair": {}}})
    model(torch.randn(3, 4)).backward()
    optimizer.step()
    mon.close()
    names = {k[2] for k in rows_by_key(rank_dir(output_dir), "actv")}
    assert names == {"pair.input", "pair.output_0", "pair.output_1"}


def test_micro_steps_are_numbered_within_each_step(write_config, output_dir):
    model = MLP()
    mon, optimizer = monitored(write_config, model, {"targets": {"fc2": {}}}, grad_acc=3)
    for _ in range(2):
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    out_dir = rank_dir(output_dir)
    for category in ("actv", "actv_grad"):
        keys = {(s, m) for s, m, _ in rows_by_key(out_dir, category)}
        assert keys == {(s, m) for s in (0, 1) for m in (0, 1, 2)}, category


class Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.block(torch.tanh(self.block(x))).sum()


def test_with_xy_each_call_a_module_called_twice_gets_name_and_name_1(write_config, output_dir):
    model = Shared()
    mon, optimizer = monitored(write_config, model, {"all_xy": True, "xy_each_call": True})
    for _ in range(2):
        model(torch.randn(3, 4)).backward()
    optimizer.step()
    mon.close()
    actv = rows_by_key(rank_dir(output_dir), "actv")
    assert {k for k in actv if k[2].startswith("block")} == {
        (0, m, n) for m in (0, 1) for n in ("block.input", "block.output", "block_1.input", "block_1.output")
    }
    grads = rows_by_key(rank_dir(output_dir), "actv_grad")
    assert (0, 1, "block_1.output") in grads and (0, 1, "block.output") in grads


class Checkpointed(torch.nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inner = MLP()
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(checkpoint(self.inner, x, use_reentrant=self.reentrant)).sum()


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_modules_are_recorded_once(write_config, output_dir, reentrant):
    model = Checkpointed(reentrant)
    mon, optimizer = monitored(write_config, model, {"all_xy": True})
    x = torch.randn(3, 8, requires_grad=reentrant)
    model(x).backward()
    optimizer.step()
    mon.close()
    out_dir = rank_dir(output_dir)
    actv = [r["name"] for r in read_csv_rows(out_dir, "actv")]
    assert actv.count("inner.fc1.output") == 1 and "inner.fc1_1.output" not in actv
    grads = [r["name"] for r in read_csv_rows(out_dir, "actv_grad")]
    assert grads.count("inner.fc2.output") == 1
    assert grads.count("inner.fc1.output") == 1


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    aux: torch.Tensor | None = None


class DictModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.nn.Linear(4, 4)

    def forward(self, x, scale=None):
        h = self.enc(x)
        return {"hidden": h, "extra": (h * scale, None), "note": "text"}


class Wrapper(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = DictModel()

    def forward(self, x):
        out = self.body(x, scale=torch.tensor(2.0))
        return Output(out["hidden"], out["extra"][0])


def test_dict_dataclass_and_nested_outputs_and_tensor_kwargs(write_config, output_dir):
    model = Wrapper()
    mon, optimizer = monitored(write_config, model, {"targets": {"body": {}}})
    out = model(torch.randn(2, 4))
    (out.logits.sum() + out.aux.sum()).backward()
    optimizer.step()
    mon.close()
    names = {k[2] for k in rows_by_key(rank_dir(output_dir), "actv")}
    assert names == {"body.input_0", "body.input_1", "body.output_0", "body.output_1"}


def test_eval_passes_record_nothing(write_config, output_dir):
    model = MLP()
    mon, optimizer = monitored(write_config, model, {"all_xy": True})
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 8))
    model.train()
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    mon.close()
    rows = read_csv_rows(rank_dir(output_dir), "actv")
    assert {r["micro_step"] for r in rows} == {"0"} and len([r for r in rows if r["name"] == "fc1.input"]) == 1


def test_forward_only_and_backward_only(write_config, output_dir):
    for flag, present, absent in (("forward_only", "actv", "actv_grad"), ("backward_only", "actv_grad", "actv")):
        model = MLP()
        mon, optimizer = monitored(write_config, model, {"all_xy": True, flag: True})
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        mon.close()
        out_dir = mon.log_dir
        from pathlib import Path

        assert read_csv_rows(Path(out_dir), present) and not read_csv_rows(Path(out_dir), absent)


def test_row_keys_are_made_once_and_the_same_objects_name_every_step(write_config, output_dir):
    """A key per row per step would be hundreds of new objects per step for the garbage
    collector, whose collections stop the training; the same key object names a tensor every
    step (and the values stay right, as the other tests show)."""
    torch.manual_seed(0)
    model = MLP()
    mon, optimizer = monitored(write_config, model, {"all_xy": True, "format": "api"}, grad_acc=2)
    api = mon.output.api
    keys_by_step = []
    for _ in range(3):
        for _ in range(2):
            model(torch.randn(6, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        mon.output.writer.drain()
        keys_by_step.append({category: list(api._latest[category].keys) for category in ("actv", "actv_grad")})
    mon.close()
    first, *later = keys_by_step
    for category in ("actv", "actv_grad"):
        assert len(first[category]) > 8  # both micro-steps of every module
        for step in later:
            assert step[category] == first[category]
            assert all(a is b for a, b in zip(step[category], first[category]))


class AskedAttributes(torch.nn.Linear):
    """Records every attribute it is asked for and lacks (Module.__getattr__ raises
    AttributeError, which a getattr with a default then catches)."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            self.__dict__.setdefault("missing", []).append(name)
            raise


def test_forward_hooks_on_the_kernel_path_ask_no_module_for_an_attribute_it_lacks(write_config, output_dir):
    """A monitored forward pass makes torch raise and catch no AttributeError per module: the
    in-place check (read the device path's notes before an in-place module overwrites its
    input) asks for `inplace` only while notes are waiting, which the CPU's kernel path never has."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(AskedAttributes(8, 8), torch.nn.ReLU(), AskedAttributes(8, 2))
    mon, optimizer = monitored(write_config, model, {"all_xy": True})
    for linear in (model[0], model[2]):
        linear.__dict__["missing"] = []  # the steps' lookups only (building a Linear has its own)
    for _ in range(2):
        model(torch.randn(6, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    assert model[0].__dict__["missing"] == [] and model[2].__dict__["missing"] == []
    assert {r["name"] for r in read_csv_rows(rank_dir(output_dir), "actv")} >= {"0.output", "2.output"}
