"""msmon is a guest in the user's process: what it attaches to modules stays invisible to
pickling, copying and torch.compile, and what scripts do with modules (loops, no_grad forwards,
EMA copies) is recorded as it is, not as something else."""

from __future__ import annotations

import copy
import io
import logging
import pickle
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import ALL_OPS, ROOT, assert_row_matches, rank_dir, read_csv_rows, reference_stats
from msmon import TrainerMon
from plain_models import LstmNet

EVERY_MODULE_HOOK = {
    "all_xy": True,
    "wg_distribution": True,
    "format": "csv",
    "ops": ALL_OPS,
    "alert": {"rules": [{"rule_name": "AnomalyNan"}]},
}  # + the non-finite origin hooks


def attach(write_config, model, cfg=EVERY_MODULE_HOOK):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = TrainerMon(write_config(cfg), params_have_main_grad=False)
    mon.set_monitor(model, optimizer)
    return mon, optimizer


def step(model, optimizer, x):
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def test_torch_save_of_a_whole_monitored_model_holds_nothing_of_msmon_and_loads_without_it(
    write_config, output_dir, tmp_path
):
    torch.manual_seed(0)
    model = LstmNet()
    mon, optimizer = attach(write_config, model)
    x = torch.randn(3, 5, 4)
    step(model, optimizer, x)
    path = tmp_path / "model.pt"
    torch.save(model, path)  # while the hooks are attached, as pytorch/examples does
    step(model, optimizer, x)  # and monitoring goes on afterwards
    assert b"msmon" not in path.read_bytes()
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert b"msmon" not in pickle.dumps(model, protocol=protocol)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an output with msmon's gradient hooks saves silently
        torch.save(model(x), tmp_path / "out.pt")
    mon.close()
    # a process that never imports msmon loads it, runs it, and finds no hook of msmon's
    code = (
        f"import sys, torch; sys.modules['msmon'] = None; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        f"m = torch.load({str(path)!r}, weights_only=False)\n"
        "hooks = [d for mod in m.modules() for d in (mod._forward_pre_hooks, mod._forward_hooks) if d]\n"
        "assert not hooks, hooks\n"
        f"print(m(torch.load({str(tmp_path / 'x.pt')!r})).shape)\n"
    )
    torch.save(x, tmp_path / "x.pt")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch.Size([3, 5, 2])" in done.stdout
    assert len(read_csv_rows(rank_dir(output_dir), "actv")) > 0


def test_user_hooks_still_travel_with_a_pickled_model_while_msmon_hooks_do_not(write_config, output_dir):
    model = LstmNet()
    model.rnn.register_forward_hook(_user_hook)  # a picklable hook of the user's own
    mon, optimizer = attach(write_config, model)
    step(model, optimizer, torch.randn(2, 3, 4))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert list(loaded.rnn._forward_hooks.values()) == [_user_hook]
    assert len(model.rnn._forward_hooks) > 1  # the original keeps msmon's hooks too
    mon.close()
    assert list(model.rnn._forward_hooks.values()) == [_user_hook]


def _user_hook(module, args, output):
    return None


def test_a_deep_copy_of_a_monitored_model_is_not_recorded_as_the_original(write_config, output_dir):
    torch.manual_seed(0)
    model = LstmNet()
    mon, optimizer = attach(write_config, model)
    ema = copy.deepcopy(model)  # an EMA / teacher copy made after the monitor attached
    shallow = copy.copy(model)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in ema.modules())
    assert not shallow._forward_pre_hooks and not shallow._forward_hooks
    x = torch.randn(3, 5, 4)
    for _ in range(2):
        step(model, optimizer, x)
        ema(x).sum().backward()  # the copy runs forward and backward in training mode
    mon.close()
    out_dir = rank_dir(output_dir)
    for category in ("actv", "actv_grad"):
        rows = read_csv_rows(out_dir, category)
        assert rows and {r["micro_step"] for r in rows} == {"0"}, category
        assert not [r for r in rows if r["name"].startswith(("embed_1", "head_1", "rnn_1"))], category
    names = {r["name"] for r in read_csv_rows(out_dir, "grad_unreduced")}
    assert names == {n for n, _ in model.named_parameters()}


class Cell(torch.nn.Module):
    """One LSTMCell run over the time steps in a Python loop (time_sequence_prediction)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = torch.nn.LSTMCell(3, 5)
        self.head = torch.nn.Linear(5, 1)

    def forward(self, x):
        h = c = torch.zeros(x.shape[0], 5)
        outs = []
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
            outs.append(self.head(h))
        return torch.stack(outs, 1)


def test_a_module_called_in_a_loop_gives_one_row_per_micro_step_combining_every_call(write_config, output_dir, caplog):
    torch.manual_seed(0)
    model = Cell()
    mon, optimizer = attach(write_config, model, {**EVERY_MODULE_HOOK, "alert": {}})
    x = torch.randn(4, 60, 3)
    with caplog.at_level(logging.WARNING, logger="msmon"):
        for _ in range(2):
            step(model, optimizer, x)
    mon.close()
    repeats = [r for r in caplog.records if "ran more than once" in r.getMessage()]
    assert len(repeats) == 1 and "cell x60" in repeats[0].getMessage()

    out_dir = rank_dir(output_dir)
    actv = read_csv_rows(out_dir, "actv")
    names = {r["name"] for r in actv}
    assert names == {
        "cell.input_0",
        "cell.input_1",
        "cell.input_2",
        "cell.output_0",
        "cell.output_1",
        "head.input",
        "head.output",
    }
    assert len(actv) == 2 * len(names)  # one row per name and step: bounded whatever the loop length

    # an independent recomputation of the first step: every call's tensors together
    torch.manual_seed(0)
    ref = Cell()
    h = c = torch.zeros(4, 5)
    hs, cs, heads = [], [], []
    for t in range(x.shape[1]):
        h, c = ref.cell(x[:, t], (h, c))
        hs.append(h)
        cs.append(c)
        heads.append(ref.head(h))
    step0 = {r["name"]: r for r in actv if r["step"] == "0"}
    assert_row_matches(step0["cell.output_0"], reference_stats(torch.cat(hs)))
    assert_row_matches(step0["cell.output_1"], reference_stats(torch.cat(cs)))
    assert_row_matches(step0["head.output"], reference_stats(torch.cat(heads)))
    assert_row_matches(step0["cell.input_0"], reference_stats(x.transpose(0, 1).reshape(-1, 3)))
    grads = {r["name"] for r in read_csv_rows(out_dir, "actv_grad")}
    assert grads == {"cell.input_1", "cell.input_2", "cell.output_0", "cell.output_1", "head.input", "head.output"}


def test_a_no_grad_forward_in_training_mode_shifts_no_micro_step(write_config, output_dir):
    torch.manual_seed(0)
    model = LstmNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"all_xy": True, "format": "csv", "ops": ALL_OPS}))
    mon.set_monitor(model, optimizer, grad_acc_steps=2)
    batches = [torch.randn(2, 3, 4), torch.randn(2, 3, 4)]
    model(batches[0]).sum().backward()
    with torch.no_grad():  # a metric on another batch, still in training mode
        model(torch.full((2, 3, 4), 100.0))
    out = model(batches[1])
    out.sum().backward()
    optimizer.step()
    mon.close()
    actv = read_csv_rows(rank_dir(output_dir), "actv")
    assert {r["micro_step"] for r in actv} == {"0", "1"}
    assert not [r for r in actv if r["name"].split(".")[0].endswith("_1")]  # no second call seen
    head = {r["micro_step"]: r for r in actv if r["name"] == "head.output"}
    assert_row_matches(head["1"], reference_stats(out))


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))


def compiled_losses(write_config, monitored: bool):
    torch.manual_seed(0)
    model = Small()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = None
    if monitored:
        mon = TrainerMon(write_config(EVERY_MODULE_HOOK), params_have_main_grad=False)
        mon.set_monitor(model, optimizer)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    x = torch.randn(16, 4)
    losses = [step(compiled, optimizer, x) for _ in range(3)]
    explained = torch._dynamo.explain(model)(x)
    return losses, explained.graph_break_count, mon


def test_a_torch_compiled_model_compiles_in_one_graph_and_trains_identically(write_config, output_dir, caplog):
    plain, _, _ = compiled_losses(write_config, monitored=False)
    with caplog.at_level(logging.WARNING, logger="msmon"):
        losses, breaks, mon = compiled_losses(write_config, monitored=True)
        mon.close()
    assert breaks == 0
    assert [float(v) for v in losses] == [float(v) for v in plain]  # bit-identical
    out_dir = rank_dir(output_dir)
    assert {r["step"] for r in read_csv_rows(out_dir, "grad_reduced")} == {"0", "1", "2"}
    told = [r for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(told) == 1


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_detaching_the_last_monitor_leaves_nn_module_as_torch_made_it(write_config, output_dir, protocol):
    assert "__reduce_ex__" not in torch.nn.Module.__dict__
    model = LstmNet()
    mon, optimizer = attach(write_config, model)
    assert "__reduce_ex__" in torch.nn.Module.__dict__
    step(model, optimizer, torch.randn(2, 3, 4))
    mon.close()
    assert "__reduce_ex__" not in torch.nn.Module.__dict__
    assert pickle.loads(pickle.dumps(model, protocol=protocol)).embed.weight.equal(model.embed.weight)
