"""L2 features end to end: `recording_l2_features` with `l2_targets` on an attention model and
a mixture of experts, every value checked against a direct computation on the same tensors,
in msprobe's files and tags; bad config as errors before training; training unchanged."""

from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import l2_reference as direct
from conftest import ROOT, rank_dir, read_csv_rows
from l2_models import AttentionLM, MoEModel
from msmon import TrainerMon
from msmon.config import SA_ORDERS, ConfigError, parse_config

CORES = ["layers.0.core", "layers.1.core"]


def lm_step(model: torch.nn.Module, gen: torch.Generator, batch: int = 2, seq: int = 12) -> float:
    idx = torch.randint(0, 40, (batch, seq), generator=gen)
    loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    return loss.item()


def moe_step(model: torch.nn.Module, gen: torch.Generator) -> float:
    x = torch.randn(3, 5, 8, generator=gen)
    loss = (model(x) - x.sum(-1, keepdim=True)).square().mean()
    loss.backward()
    return loss.item()


def train(model, config_path, step_fn, steps=3, micro=2, between=None):
    """Losses of `steps` optimizer steps of `micro` micro-batches; the monitor closed after."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = None
    if config_path:
        mon = TrainerMon(config_path)
        mon.set_monitor(model, optimizer)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        for _ in range(micro):
            losses.append(step_fn(model, gen))
        if between is not None:
            between(step)
        optimizer.step()
        optimizer.zero_grad()
    if mon is not None:
        mon.close()
    return losses


def capture_inputs(modules: dict[str, torch.nn.Module], store: list) -> None:
    """The test's own hook, registered before msmon's: what each module received, copied."""
    for name, module in modules.items():
        module.register_forward_pre_hook(
            lambda m, args, name=name: (
                store.append((name, [a.detach().clone() for a in args]))
                if m.training and torch.is_grad_enabled()
                else None
            )
        )


def config(**l2) -> dict:
    return {"recording_l2_features": True, "format": ["csv"], "ndigits": 12, **l2}


# -- values ------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", SA_ORDERS)
def test_attention_entropy_and_softmax_max_equal_the_direct_computation_on_every_head(order, write_config, output_dir):
    torch.manual_seed(0)
    model = AttentionLM(order=order)
    seen: list = []
    capture_inputs({n: model.get_submodule(n) for n in CORES}, seen)

    def eval_and_no_grad_forwards(step):  # neither is recorded, and neither shifts a micro-step
        idx = torch.randint(0, 40, (2, 12))
        with torch.no_grad():
            model(idx)
        model.eval()
        model(idx)
        model.train()

    train(
        model,
        write_config(config(sa_order=order, l2_targets={"attention_hook": CORES})),
        lm_step,
        between=eval_and_no_grad_forwards,
    )
    rows = read_csv_rows(rank_dir(output_dir), "attention_hook")
    assert list(rows[0]) == ["vpp_stage", "name", "step", "micro_step", "entropy", "softmax_max"]
    assert len(rows) == 3 * 2 * 2 == len(seen)  # steps x micro-steps x modules
    for row, (name, (q, k, _v)) in zip(rows, seen):
        entropy, top = direct.attention(direct.to_bhsd(q, order), direct.to_bhsd(k, order))
        assert row["name"] == f"{name}.attention" and row["vpp_stage"] == "0"
        assert float(row["entropy"]) == pytest.approx(entropy, rel=1e-5)
        assert float(row["softmax_max"]) == pytest.approx(top, rel=1e-5)
    assert [(r["step"], r["micro_step"]) for r in rows[:4]] == [("0", "0"), ("0", "0"), ("0", "1"), ("0", "1")]


def test_long_sequences_use_a_fixed_row_sample_of_every_head(write_config, tmp_path, monkeypatch):
    """seq 40, batch 2: 16 of 40 query rows per head and batch element, the same rows every
    step and every run (the sample's generator is seeded from the module's name)."""

    def run(out):
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
        torch.manual_seed(0)
        model = AttentionLM()
        train(
            model,
            write_config(config(l2_targets={"attention_hook": CORES[:1]})),
            lambda m, g: lm_step(m, g, seq=40),
            steps=2,
            micro=1,
        )
        return [(r["entropy"], r["softmax_max"]) for r in read_csv_rows(rank_dir(out), "attention_hook")]

    first = run(tmp_path / "first")
    assert run(tmp_path / "second") == first and len(first) == 2


def test_linear_hook_with_an_empty_list_takes_every_2d_weight_but_embeddings(write_config, output_dir):
    torch.manual_seed(0)
    model = AttentionLM()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    weights: list[dict[str, torch.Tensor]] = []
    train(
        model,
        write_config(config(l2_targets={"linear_hook": []})),
        lm_step,
        steps=4,
        between=lambda step: weights.append({n: m.weight.detach().clone() for n, m in linears.items()}),
    )
    rows = read_csv_rows(rank_dir(output_dir), "linear_hook")
    assert list(rows[0]) == ["vpp_stage", "name", "step", "sr", "kernel_norm"]
    assert {r["name"] for r in rows} == {f"{n}.linear" for n in linears}  # no embed, no norms
    assert len(rows) == 4 * len(linears)  # once per step, not per micro-step
    for row in rows:
        w = weights[int(row["step"])][row["name"].removesuffix(".linear")]  # the weight that step's forward saw
        sigma, stable_rank = direct.spectral(w)
        assert float(row["kernel_norm"]) == pytest.approx(sigma, rel=1e-4)
        assert float(row["sr"]) == pytest.approx(stable_rank, rel=2e-4)
        assert float(row["sr"]) == pytest.approx(
            float(w.double().norm()) ** 2 / float(row["kernel_norm"]) ** 2, rel=1e-6
        )


def test_moe_router_weight_similarity_and_logit_entropy_equal_the_explicit_computation(write_config, output_dir):
    torch.manual_seed(0)
    model = MoEModel()
    logits: list[torch.Tensor] = []
    model.moe.router.register_forward_hook(lambda m, a, out: logits.append(out.detach().clone()))
    router_weights: list[torch.Tensor] = []
    cfg = config(l2_targets={"moe_router_weight_hook": ["moe.router"], "moe_router_logit_hook": ["moe.router"]})
    train(
        model,
        write_config(cfg),
        moe_step,
        between=lambda step: router_weights.append(model.moe.router.weight.detach().clone()),
    )
    out = rank_dir(output_dir)
    weight_rows = read_csv_rows(out, "moe_router_weight_hook")
    assert list(weight_rows[0]) == ["vpp_stage", "name", "step", "router_weight_similarity"]
    assert [(r["name"], r["step"]) for r in weight_rows] == [("moe.router.moe_router", str(s)) for s in range(3)]
    for row in weight_rows:
        # nn.Linear(16, 6).weight is [6 experts, 16]: rows are the experts
        assert float(row["router_weight_similarity"]) == pytest.approx(
            direct.mean_cosine(router_weights[int(row["step"])]), rel=1e-6, abs=1e-9
        )
    logit_rows = read_csv_rows(out, "moe_router_logit_hook")
    assert list(logit_rows[0]) == ["vpp_stage", "name", "step", "micro_step", "per_token_expert_entropy"]
    assert len(logit_rows) == len(logits) == 6
    for row, seen in zip(logit_rows, logits):
        assert float(row["per_token_expert_entropy"]) == pytest.approx(direct.logit_entropy(seen), rel=1e-5)


def test_tensorboard_tags_are_msprobes(write_config, output_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    model = AttentionLM()
    train(
        model,
        write_config(
            {**config(l2_targets={"attention_hook": CORES[:1], "linear_hook": ["head"]}), "format": ["tensorboard"]}
        ),
        lm_step,
        steps=2,
    )
    moe = MoEModel()
    train(
        moe,
        write_config(
            {
                **config(
                    l2_targets={"moe_router_weight_hook": ["moe.router"], "moe_router_logit_hook": ["moe.router"]}
                ),
                "format": ["tensorboard"],
            },
            "moe.json",
        ),
        moe_step,
        steps=2,
    )
    tags = set()
    for path in output_dir.iterdir():
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
        if "0:head.linear/rank0/sr_kernel_norm" in acc.Tags()["scalars"]:
            assert [e.step for e in acc.Scalars("0:head.linear/rank0/sr_kernel_norm")] == [0, 1]
    assert tags == {
        "0:layers.0.core.attention:0/rank0/qkt_entropy",
        "0:layers.0.core.attention:0/rank0/qkt_softmax_max",
        "0:layers.0.core.attention:1/rank0/qkt_entropy",
        "0:layers.0.core.attention:1/rank0/qkt_softmax_max",
        "0:head.linear/rank0/sr_sr",
        "0:head.linear/rank0/sr_kernel_norm",
        "0:moe.router.moe_router/rank0/router_weight_router_weight_similarity",
        "0:moe.router.moe_router:0/rank0/router_logit_per_token_expert_entropy",
        "0:moe.router.moe_router:1/rank0/router_logit_per_token_expert_entropy",
    }


def test_features_leave_the_statistics_files_as_they_were(write_config, output_dir):
    """With activations on as well, `actv` rows and the feature rows go through one buffer and
    one copy per step; each category gets its own file with its own columns."""
    torch.manual_seed(0)
    model = AttentionLM(layers=1)
    train(
        model,
        write_config(
            {
                **config(l2_targets={"attention_hook": CORES[:1], "linear_hook": ["head"]}),
                "xy_distribution": True,
                "targets": {"head": {}},
                "ops": ["norm"],
            }
        ),
        lm_step,
        steps=1,
    )
    out = rank_dir(output_dir)
    actv = read_csv_rows(out, "actv")
    assert list(actv[0]) == ["vpp_stage", "name", "step", "micro_step", "norm"]
    assert {r["name"] for r in actv} == {"head.input", "head.output"}
    assert len(read_csv_rows(out, "attention_hook")) == 2 and len(read_csv_rows(out, "linear_hook")) == 1


# -- training unchanged --------------------------------------------------------------------------
def test_losses_and_weights_are_bit_identical_with_and_without_every_feature(write_config, output_dir):
    def run(model_cls, step_fn, cfg):
        torch.manual_seed(0)
        model = model_cls()
        losses = train(model, write_config(cfg) if cfg else None, step_fn, steps=4)
        return losses, model.state_dict()

    lm_cfg = config(l2_targets={"attention_hook": CORES, "linear_hook": []})
    moe_cfg = config(
        l2_targets={
            "linear_hook": [],
            "moe_router_weight_hook": ["moe.router"],
            "moe_router_logit_hook": ["moe.router"],
        }
    )
    for model_cls, step_fn, cfg in ((AttentionLM, lm_step, lm_cfg), (MoEModel, moe_step, moe_cfg)):
        plain_losses, plain = run(model_cls, step_fn, None)
        losses, monitored = run(model_cls, step_fn, cfg)
        assert losses == plain_losses
        assert all(torch.equal(plain[k], monitored[k]) for k in plain)


# -- what does not fit ---------------------------------------------------------------------------
class Gate(torch.nn.Module):
    """Receives two 3-D tensors: not q and k in any attention layout."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * torch.sigmoid(b)


class GatedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = AttentionLM(layers=1)
        self.gate = Gate()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.lm(idx)
        return self.gate(logits, logits)


def test_an_attention_target_without_q_and_k_is_named_once_and_the_others_keep_recording(
    write_config, output_dir, caplog
):
    logging.getLogger("msmon").propagate = True
    torch.manual_seed(0)
    model = GatedLM()
    cfg = config(l2_targets={"attention_hook": ["lm.head", "gate", "lm.layers.0.core"], "linear_hook": ["lm.head"]})
    with caplog.at_level(logging.WARNING, logger="msmon"):
        train(model, write_config(cfg), lm_step, steps=2)
    warned = [r.getMessage() for r in caplog.records if "l2_targets" in r.getMessage()]
    assert len(warned) == 2  # each module once, not once per call
    assert any("lm.head" in w and "does not receive q and k" in w for w in warned)
    assert any("gate" in w and "4-D" in w and "(sa_order is 's,b,h,d')" in w for w in warned)
    out = rank_dir(output_dir)
    assert {r["name"] for r in read_csv_rows(out, "attention_hook")} == {"lm.layers.0.core.attention"}
    assert len(read_csv_rows(out, "linear_hook")) == 2


# -- config -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg, message",
    [
        (
            {"l2_targets": {"atention_hook": []}},
            "l2_targets: unknown hook 'atention_hook'; expected ['attention_hook', 'linear_hook', 'moe_router_weight_hook', "  # noqa: E501
            "'moe_router_logit_hook'] (did you mean 'attention_hook', 'linear_hook'?)",
        ),
        (
            {"l2_targets": {"linear_hook": "fc1"}},
            "l2_targets['linear_hook']: expected a list of module names, got 'fc1'",
        ),
        ({"l2_targets": {"linear_hook": [1]}}, "l2_targets['linear_hook']: expected a list of module names, got [1]"),
        ({"l2_targets": ["linear_hook"]}, "l2_targets: expected an object {hook: [module names]}"),
        ({"sa_order": "b,h,d,s"}, "sa_order: expected one of ['s,b,h,d', 'b,s,h,d', 'b,h,s,d']"),
        ({"sa_order": 3}, "sa_order: expected one of"),
        ({"recording_l2_features": "yes"}, "recording_l2_features: expected true or false, got 'yes' (str)"),
    ],
)
def test_bad_l2_keys_are_config_errors(cfg, message):
    with pytest.raises(ConfigError) as err:
        parse_config(cfg)
    assert str(err.value).startswith(message)


def test_l2_keys_parse_and_sa_order_may_have_spaces(caplog):
    cfg = parse_config(
        {
            "recording_l2_features": True,
            "sa_order": "b, s, h, d",
            "l2_targets": {"linear_hook": [], "attention_hook": ["a", "a", "b"]},
        }
    )
    assert cfg.sa_order == "b,s,h,d" and cfg.l2_targets == {"linear_hook": [], "attention_hook": ["a", "b"]}
    assert parse_config({}).sa_order == "s,b,h,d"
    logging.getLogger("msmon").propagate = True
    with caplog.at_level(logging.WARNING, logger="msmon"):
        parse_config({"recording_l2_features": True})
        parse_config({"l2_targets": {"linear_hook": []}})
    assert [r.getMessage() for r in caplog.records] == [
        "msmon: recording_l2_features is true but l2_targets names no hook; no L2 feature is recorded",
        "msmon: l2_targets is set but recording_l2_features is not true; no L2 feature is recorded",
    ]


@pytest.mark.parametrize(
    "targets, message",
    [
        (
            {"attention_hook": ["layers.0.cor"]},
            "l2_targets['attention_hook']: 'layers.0.cor' names no module of the model; closest names: layers.0.core",
        ),
        ({"linear_hook": ["1:head"]}, "l2_targets['linear_hook']: '1:head' names no module of the model"),
        (
            {"linear_hook": ["norms.0"]},
            "l2_targets['linear_hook']: 'norms.0' (LayerNorm) has no 2-D `weight` or `wg` to compute its features from",
        ),
        (
            {"moe_router_weight_hook": ["layers.0.core"]},
            "l2_targets['moe_router_weight_hook']: 'layers.0.core' (CoreAttention) has no 2-D `weight`",
        ),
    ],
)
def test_a_target_that_names_no_fitting_module_is_a_config_error_at_set_monitor(
    targets, message, write_config, output_dir
):
    model = AttentionLM()
    mon = TrainerMon(write_config(config(l2_targets=targets)))
    with pytest.raises(ConfigError) as err:
        mon.set_monitor(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert str(err.value).startswith(message)
    mon.close()


def test_a_vpp_prefixed_target_names_one_chunk(write_config, output_dir):
    torch.manual_seed(0)
    chunks = [AttentionLM(layers=1), AttentionLM(layers=1)]
    optimizer = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=0.1)
    mon = TrainerMon(write_config(config(l2_targets={"linear_hook": ["1:head", "layers.0.q_proj"]})))
    mon.set_monitor(chunks, optimizer)
    gen = torch.Generator().manual_seed(0)
    for chunk in chunks:
        lm_step(chunk, gen)
    optimizer.step()
    mon.close()
    rows = read_csv_rows(rank_dir(output_dir), "linear_hook")
    assert sorted((r["vpp_stage"], r["name"]) for r in rows) == [
        ("0", "layers.0.q_proj.linear"),
        ("1", "head.linear"),
        ("1", "layers.0.q_proj.linear"),
    ]


class LoopedLM(torch.nn.Module):
    """One attention block run twice per forward (a shared block, as in a looped transformer)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = AttentionLM(layers=1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.lm.embed(idx)
        for _ in range(2):
            x = x + self.lm.layers[0](self.lm.norms[0](x))
        return self.lm.head(x)


def test_a_module_called_twice_in_a_micro_step_gives_one_row_the_mean_of_its_calls(write_config, output_dir):
    torch.manual_seed(0)
    model = LoopedLM()
    seen: list = []
    capture_inputs({"lm.layers.0.core": model.lm.layers[0].core}, seen)
    train(model, write_config(config(l2_targets={"attention_hook": ["lm.layers.0.core"]})), lm_step, steps=1)
    rows = read_csv_rows(rank_dir(output_dir), "attention_hook")
    assert [r["micro_step"] for r in rows] == ["0", "1"]
    for row, calls in zip(rows, (seen[0:2], seen[2:4])):
        values = [
            direct.attention(direct.to_bhsd(q, "s,b,h,d"), direct.to_bhsd(k, "s,b,h,d")) for _, (q, k, _v) in calls
        ]
        assert float(row["entropy"]) == pytest.approx(sum(v[0] for v in values) / 2, rel=1e-5)
        assert float(row["softmax_max"]) == pytest.approx(sum(v[1] for v in values) / 2, rel=1e-5)


def test_an_l2_target_naming_no_module_stops_an_unmodified_job_before_training(write_config, output_dir):
    from msmon.hooks import Session, StopBeforeTraining, torch_optim

    session = Session.from_file(write_config(config(l2_targets={"linear_hook": ["lm.haed"]})), TrainerMon)
    torch_optim.instrument(session)
    try:
        model = GatedLM()
        with pytest.raises(StopBeforeTraining):
            torch.optim.AdamW(model.parameters(), lr=0.1)
        assert session.error.startswith(
            "l2_targets['linear_hook']: 'lm.haed' names no module of the model; closest names: lm.head"
        )
    finally:
        torch_optim.uninstrument()
        for monitor in list(session.monitors):
            monitor.close()


def test_a_config_edit_switches_features_on_and_keeps_the_warm_vectors(tmp_path, output_dir):
    from msmon.collectors.l2_features import collector as l2_features

    def write(cfg, stamp):
        path.write_text(json.dumps(cfg))
        os.utime(path, ns=(stamp, stamp))

    path = tmp_path / "monitor.json"
    write({"format": "csv", "ndigits": 12}, 1_000_000_000)
    torch.manual_seed(0)
    model = AttentionLM(layers=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(str(path))
    mon.set_monitor(model, optimizer)
    gen = torch.Generator().manual_seed(0)

    def step():
        lm_step(model, gen)
        optimizer.step()
        optimizer.zero_grad()

    step()
    write(config(l2_targets={"linear_hook": ["head"]}), 2_000_000_000)
    step()  # the edit is read at the end of this step
    step()
    kept = l2_features._VECTORS[model.head]
    write(config(l2_targets={"linear_hook": ["head"], "attention_hook": ["layers.0.core"]}), 3_000_000_000)
    step()
    assert l2_features._VECTORS[model.head].shape == kept.shape  # the rebuilt collector started warm
    step()
    mon.close()
    out = rank_dir(output_dir)
    assert [r["step"] for r in read_csv_rows(out, "linear_hook")] == ["2", "3", "4"]
    assert {r["step"] for r in read_csv_rows(out, "attention_hook")} == {"4"}
    for row in read_csv_rows(out, "linear_hook"):
        assert float(row["kernel_norm"]) > 0


def test_an_l2_target_in_another_model_of_the_process_leaves_this_optimizer_alone(write_config, output_dir):
    """Two models, two optimizers (a GAN): the features of the model that has the module."""
    from msmon.hooks import Session, torch_optim

    session = Session.from_file(write_config(config(l2_targets={"moe_router_logit_hook": ["moe.router"]})), TrainerMon)
    torch_optim.instrument(session)
    try:
        lm, moe = AttentionLM(), MoEModel()
        torch.optim.AdamW(lm.parameters(), lr=0.1)
        moe_optimizer = torch.optim.AdamW(moe.parameters(), lr=0.1)
        moe_step(moe, torch.Generator().manual_seed(0))
        moe_optimizer.step()
        assert session.error is None and len(session.monitors) == 1
    finally:
        torch_optim.uninstrument()
        for monitor in list(session.monitors):
            monitor.close()
    assert len(read_csv_rows(rank_dir(output_dir), "moe_router_logit_hook")) == 1


@pytest.mark.e2e
def test_an_unmodified_ddp_job_under_msmon_run_records_the_features_on_every_rank(write_config, tmp_path):
    script = str(ROOT / "tests" / "scripts" / "l2_ddp.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env["OMP_NUM_THREADS"] = "1"
    two = ["--standalone", "--nproc-per-node", "2"]
    cfg = write_config(config(sa_order="b,s,h,d", l2_targets={"attention_hook": CORES, "linear_hook": []}))
    out, monitored, plain = tmp_path / "out", tmp_path / "monitored", tmp_path / "plain"
    monitored.mkdir(), plain.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "msmon.launcher",
            "run",
            "--config",
            cfg,
            "--output-dir",
            str(out),
            *two,
            "--",
            script,
            str(monitored),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *two, script, str(plain)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        losses = (monitored / f"rank{rank}.txt").read_text()
        assert len(losses.split()) == 3 and losses == (plain / f"rank{rank}.txt").read_text()
    per_rank = []
    for rank in (0, 1):
        (directory,) = glob.glob(str(out / f"*-rank{rank}-*"))
        attention = read_csv_rows(Path(directory), "attention_hook")
        linear = read_csv_rows(Path(directory), "linear_hook")
        assert len(attention) == 3 * 2 * 2 and {r["name"] for r in attention} == {f"{c}.attention" for c in CORES}
        per_rank.append((attention, linear))
    (att0, lin0), (att1, lin1) = per_rank
    assert [r["entropy"] for r in att0] != [r["entropy"] for r in att1]  # each rank's own batches
    assert lin0 == lin1 and len(lin0) == 3 * 7  # replicated weights: the same on both ranks
