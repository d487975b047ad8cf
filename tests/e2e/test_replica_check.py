"""The replica check: data-parallel copies of the weights (and reduced gradients) are compared
by fingerprint every N steps, and the rank whose copy silently diverged is named.

The end-to-end runs use real torchrun (via `msmon run`) on 2 and 3 gloo CPU ranks with scripts
that know nothing of the monitor; the truth is the weights each rank saved at the end."""

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

from conftest import MLP, ROOT, train_steps
from msmon import TrainerMon
from msmon.anomaly.dump import AnomalyDumpWriter
from msmon.collectors.replica_check.collector import CALL_ID_BASE
from msmon.collectors.replica_check.compare import compare
from msmon.collectors.replica_check.entries import GRAD, NO_GRAD, WEIGHT, Entry
from msmon.config import ConfigError, ReplicaCheckConfig, parse_config
from msmon.offline.analyse.reading import read_dumps
from msmon.offline.analyse.verdict import order_events, verdict
from msmon.stats.fingerprint import fingerprint

SCRIPTS = ROOT / "tests" / "scripts"


# -- config ----------------------------------------------------------------------------------------
def test_replica_check_is_off_by_default_and_parses_with_its_defaults():
    assert parse_config({}).replica_check == ReplicaCheckConfig(enable=False, every=100, grads=False)
    assert parse_config({"replica_check": {"enable": True}}).replica_check == ReplicaCheckConfig(True, 100, False)
    assert parse_config(
        {"replica_check": {"enable": True, "every": 1e3, "grads": True}}
    ).replica_check == ReplicaCheckConfig(True, 1000, True)


@pytest.mark.parametrize(
    "value, fragment",
    [
        ({"enable": 1}, "replica_check.enable: expected true or false, got 1"),
        ({"grads": "yes"}, "replica_check.grads: expected true or false, got 'yes'"),
        ({"every": 0}, "replica_check.every: expected an integer >= 1, got 0"),
        ({"every": 2.5}, "replica_check.every: expected an integer, got 2.5"),
        ({"every": "10"}, "replica_check.every: expected an integer, got '10'"),
        ({"evry": 10}, "replica_check: unknown key 'evry' (did you mean 'every'?)"),
        (True, "replica_check: expected an object"),
    ],
)
def test_a_bad_replica_check_is_a_config_error_naming_the_key(value, fragment):
    with pytest.raises(ConfigError) as err:
        parse_config({"replica_check": value})
    assert fragment in str(err.value)


# -- comparing -------------------------------------------------------------------------------------
ENTRIES = [Entry("fc1.weight", 0, WEIGHT), Entry("fc1.bias", 0, WEIGHT), Entry("fc1.weight", 0, GRAD)]


def test_the_rank_that_differs_from_the_majority_is_named_alone():
    table = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 9, 3], [1, 2, 3]])
    (m,) = compare(table, [4, 5, 6, 7], ENTRIES)
    assert (m.entry, m.differing, m.majority) == (ENTRIES[1], [6], [4, 5, 7])
    assert m.describe() == "fc1.bias (weight after the update): rank 6 differs from the majority (ranks 4, 5, 7)"


def test_with_two_replicas_both_are_named_since_neither_is_a_majority():
    (m,) = compare(torch.tensor([[1, 2, 3], [1, 2, 4]]), [0, 1], ENTRIES)
    assert (m.differing, m.majority) == ([0, 1], [])
    assert "ranks 0, 1 hold different copies and none has a majority (copies {0} vs {1})" in m.describe()


def test_a_tie_names_every_rank_and_a_missing_gradient_is_said():
    table = torch.tensor([[5, 0, NO_GRAD], [5, 0, 7], [5, 1, 7], [5, 1, 7]])
    tie, grad = compare(table, [0, 1, 2, 3], ENTRIES)
    assert (tie.differing, tie.majority) == ([0, 1, 2, 3], [])
    assert (grad.differing, grad.majority) == ([0], [1, 2, 3])
    assert grad.describe().endswith("rank 0 has no gradient")


def test_identical_copies_are_no_mismatch():
    assert compare(torch.tensor([[1, 2, 3]] * 3), [0, 1, 2], ENTRIES) == []


def test_analyse_names_the_diverged_rank_in_its_verdict(tmp_path):
    dump = AnomalyDumpWriter(str(tmp_path), 2, 0, [2])
    dump.append(
        [
            {
                "step": 8,
                "stage": "optimizer",
                "name": "fc1.weight",
                "category": WEIGHT,
                "rule": "ReplicaMismatch",
                "op": "replica_mismatch",
                "value": 1.0,
                "call_id": CALL_ID_BASE,
                "message": "replica check: fc1.weight (weight after the update): rank 2 differs from the majority "
                "(ranks 0, 1)",
            }
        ]
    )
    text = verdict(order_events(read_dumps(str(tmp_path / "anomaly_detected")).events))
    assert text.startswith(
        "First anomaly: rank 2, step 8, weight fc1.weight after the update (copies differ across "
        "data-parallel replicas; ReplicaMismatch)."
    )
    assert (
        "Data-parallel replicas diverged: the replica check of step 8 found fc1.weight (weight after the update): "
        "rank 2 differs from the majority (ranks 0, 1); the copies on rank 2 are suspect" in text
    )


# -- one process -----------------------------------------------------------------------------------
def test_without_torch_distributed_the_check_is_off_and_training_is_unchanged(write_config, output_dir, caplog):
    torch.manual_seed(0)
    model, plain = MLP(), MLP()
    plain.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"replica_check": {"enable": True, "every": 1}, "format": "csv"}))
    with caplog.at_level(logging.INFO, logger="msmon"):
        mon.set_monitor(model, optimizer)
        torch.manual_seed(1)
        train_steps(model, optimizer, 3)
    mon.close()
    torch.manual_seed(1)
    train_steps(plain, torch.optim.SGD(plain.parameters(), lr=0.1), 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    assert "replica check off: torch.distributed is not initialised" in caplog.text


def test_edits_to_replica_check_during_the_run_are_ignored_with_a_warning(write_config, output_dir, caplog):
    path = write_config({"replica_check": {"enable": True, "every": 5}})
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(path)
    mon.set_monitor(model, optimizer)
    train_steps(model, optimizer, 1)
    with open(path, "w") as fh:
        json.dump({"replica_check": {"enable": True, "every": 1}}, fh)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    with caplog.at_level(logging.WARNING, logger="msmon"):
        train_steps(model, optimizer, 1)
    checks = [c for c in mon.collectors if c.name == "replica check"]
    mon.close()
    assert len(checks) == 1 and checks[0].state.settings.every == 5
    assert "replica_check was edited during the run; the edit takes effect in the next run" in caplog.text


def test_the_exchange_is_not_counted_as_the_trainings_communication():
    """Under cc_distribution every torch.distributed collective is reported to listeners; the
    replica check's own all_gather goes around that wrapper."""
    from msmon.collectors.replica_check.group import exchange, own_group
    from msmon.hooks import torch_distributed
    from msmon.seams import collective_listeners as cc

    seen = []

    class Listener:
        def wants(self) -> bool:
            return True

        def on_launch(self, call) -> bool:
            seen.append(call.op)
            return False

        def on_complete(self, call) -> None:
            pass

    listener = Listener()
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        torch_distributed.instrument()
        cc.add_listener(listener)
        payload = torch.tensor([3, -(2**63), 2**63 - 1])
        assert torch.equal(exchange(payload, own_group([0]), 1), payload.unsqueeze(0))
        assert seen == []
        torch.distributed.all_gather([torch.empty(3, dtype=torch.int64)], payload)
        assert seen == ["all_gather"]  # the wrapper is really in place
    finally:
        cc.remove_listener(listener)
        torch_distributed.uninstrument()
        while cc.is_instrumented():
            cc.release()
        torch.distributed.destroy_process_group()


# -- real torchrun ---------------------------------------------------------------------------------
def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def msmon_run(
    work: Path, ranks: int, config: dict, script: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    work.mkdir(parents=True, exist_ok=True)
    (work / "monitor.json").write_text(json.dumps(config))
    argv = [
        sys.executable,
        "-m",
        "msmon.launcher",
        "run",
        "--config",
        str(work / "monitor.json"),
        "--output-dir",
        str(work / "out"),
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "--",
        str(SCRIPTS / script),
        *args,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env or clean_env(), cwd=work)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def reports(work: Path, ranks: int) -> list[dict]:
    out = []
    for rank in range(ranks):
        (path,) = glob.glob(str(work / "out" / f"*-rank{rank}-*" / "replica_check.json"))
        out.append(json.loads(Path(path).read_text()))
    return out


def dump_records(work: Path) -> dict[int, list[dict]]:
    records = {}
    for path in glob.glob(str(work / "out" / "anomaly_detected" / "rank*" / "anomaly.jsonl")):
        rank = int(Path(path).parent.name.removeprefix("rank"))
        records[rank] = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return records


def differing_tensors(work: Path, ranks: int) -> dict[str, set[int]]:
    """From the weights the ranks saved at the end (the independent truth): each tensor whose
    copies differ, with the ranks whose copy differs from rank 0's."""
    saved = [torch.load(work / f"weights_rank{r}.pt") for r in range(ranks)]
    out = {}
    for name in saved[0]:
        odd = {r for r in range(1, ranks) if not torch.equal(saved[r][name], saved[0][name])}
        if odd:
            out[name] = odd
    return out


CHECK = {"alert": {"dump": True}, "format": "csv"}


@pytest.mark.e2e
def test_three_replicas_name_exactly_the_rank_whose_weight_had_a_bit_flipped(tmp_path):
    """Rank 2 flips bit 20 of one fc1.weight element at the start of step 6; checks every 4 steps."""
    proc = msmon_run(
        tmp_path,
        3,
        {**CHECK, "replica_check": {"enable": True, "every": 4, "grads": True}},
        "replica_flip.py",
        "--steps",
        "9",
        "--flip-step",
        "6",
        "--flip-rank",
        "2",
        "--out",
        str(tmp_path),
    )
    assert differing_tensors(tmp_path, 3) == {"fc1.weight": {2}}  # rank 2's differs from rank 0's, rank 1's agrees
    for rank, report in enumerate(reports(tmp_path, 3)):
        assert report["group_ranks"] == [0, 1, 2] and report["checks"] == 3 and report["off"] is None  # steps 0, 4, 8
        assert len(report["checked"]) == 8 and report["skipped"] == []  # 4 weights and 4 reduced gradients
        (mismatch,) = report["mismatches"]
        assert mismatch == {
            "step": 8,
            "tensors": [
                {
                    "name": "fc1.weight",
                    "vpp_stage": 0,
                    "category": WEIGHT,
                    "differing_ranks": [2],
                    "majority_ranks": [0, 1],
                }
            ],
        }
        line = (
            f"msmon[rank {rank}]: replica check at step 8: 1 of 8 tensors differ across data-parallel ranks 0, 1, 2: "
            "fc1.weight (weight after the update): rank 2 differs from the majority (ranks 0, 1); "
        )
        assert line in proc.stderr
    records = dump_records(tmp_path)
    assert list(records) == [2]  # only the rank whose copy differs writes a record
    (record,) = records[2]
    assert (record["step"], record["name"], record["category"], record["rule"], record["op"], record["stage"]) == (
        8,
        "fc1.weight",
        WEIGHT,
        "ReplicaMismatch",
        "replica_mismatch",
        "optimizer",
    )
    assert (record["differing_ranks"], record["majority_ranks"]) == ([2], [0, 1])
    analysed = subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "analyse", "-d", str(tmp_path / "out" / "anomaly_detected")],
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    assert analysed.returncode == 0, analysed.stderr
    assert "First anomaly: rank 2, step 8, weight fc1.weight after the update" in analysed.stdout
    assert "the copies on rank 2 are suspect" in analysed.stdout
    assert "Kind: one rank's copy of the model: the replica check found rank 2's replicated weights differing" in (
        analysed.stdout
    )


@pytest.mark.e2e
def test_two_replicas_name_both_ranks_at_the_first_check_after_the_flip_and_log_the_repeat_once(tmp_path):
    """Rank 1 flips the sign bit of fc2.bias[1] at the start of step 7; checks every 5 steps: steps
    10 and 15 find it, which each rank logs once, then counts."""
    proc = msmon_run(
        tmp_path,
        2,
        {**CHECK, "replica_check": {"enable": True, "every": 5}},
        "replica_flip.py",
        "--steps",
        "16",
        "--flip-step",
        "7",
        "--flip-rank",
        "1",
        "--flip-param",
        "fc2.bias",
        "--flip-index",
        "1",
        "--flip-bit",
        "31",
        "--out",
        str(tmp_path),
    )
    assert differing_tensors(tmp_path, 2) == {"fc2.bias": {1}}
    mismatch = {
        "tensors": [
            {
                "name": "fc2.bias",
                "vpp_stage": 0,
                "category": WEIGHT,
                "differing_ranks": [0, 1],
                "majority_ranks": [],
            }
        ],
    }
    for report in reports(tmp_path, 2):
        assert report["checks"] == 4  # steps 0, 5, 10, 15
        assert report["mismatches"] == [{"step": 10, **mismatch}, {"step": 15, **mismatch}]
    records = dump_records(tmp_path)
    assert sorted(records) == [0, 1]
    assert all(
        [(r["step"], r["name"]) for r in recs] == [(10, "fc2.bias"), (15, "fc2.bias")] for recs in records.values()
    )
    for rank in (0, 1):  # one line at the first check that found it, and one count at the close
        assert proc.stderr.count(f"msmon[rank {rank}]: replica check at step ") == 1
        assert f"msmon[rank {rank}]: replica check at step 10: 1 of 4 tensors differ" in proc.stderr
        assert (
            f"msmon alert [rank {rank}] ReplicaMismatch on the replicas of fc2.bias: alerted in 2 checks, steps 10 "
            "to 15 (the first one logged; replica_check.json lists every one; the anomaly dump too)"
        ) in proc.stderr
    analysed = subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "analyse", "-d", str(tmp_path / "out" / "anomaly_detected")],
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    assert analysed.returncode == 0, analysed.stderr
    # two replicas: no majority tells whose copy is wrong, so the kind names no one rank
    assert "Kind: one rank's copy of the model: the replica check found the copies of ranks 0, 1 differing at " in (
        analysed.stdout
    )


@pytest.mark.e2e
def test_a_bit_flipped_in_one_ranks_reduced_gradient_is_named_before_the_weight_it_spoils(tmp_path):
    """Rank 0 flips a bit of fc2.weight's gradient after the all-reduce, before the step."""
    msmon_run(
        tmp_path,
        3,
        {**CHECK, "replica_check": {"enable": True, "every": 2, "grads": True}},
        "replica_flip.py",
        "--steps",
        "5",
        "--flip-step",
        "4",
        "--flip-rank",
        "0",
        "--flip-param",
        "fc2.weight",
        "--flip-grad",
        "--out",
        str(tmp_path),
    )
    assert differing_tensors(tmp_path, 3) == {"fc2.weight": {1, 2}}  # rank 0 differs from both others
    for report in reports(tmp_path, 3):
        (mismatch,) = report["mismatches"]
        assert mismatch == {
            "step": 4,
            "tensors": [
                {
                    "name": "fc2.weight",
                    "vpp_stage": 0,
                    "category": GRAD,
                    "differing_ranks": [0],
                    "majority_ranks": [1, 2],
                },
                {
                    "name": "fc2.weight",
                    "vpp_stage": 0,
                    "category": WEIGHT,
                    "differing_ranks": [0],
                    "majority_ranks": [1, 2],
                },
            ],
        }
    events = order_events(read_dumps(str(tmp_path / "out" / "anomaly_detected")).events)
    assert [(e.rank, e.step, e.category) for e in events] == [(0, 4, GRAD), (0, 4, WEIGHT)]
    assert verdict(events).startswith("First anomaly: rank 0, step 4, reduced gradient of fc2.weight")


@pytest.mark.e2e
def test_fifty_clean_steps_with_dropout_and_clipping_raise_no_false_alarm_and_train_as_without_msmon(tmp_path):
    msmon_run(
        tmp_path,
        2,
        {**CHECK, "replica_check": {"enable": True, "every": 1, "grads": True}},
        "replica_flip.py",
        "--steps",
        "50",
        "--out",
        str(tmp_path),
    )
    assert differing_tensors(tmp_path, 2) == {}
    plain = tmp_path / "plain"
    plain.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPTS / "replica_flip.py"),
            "--steps",
            "50",
            "--out",
            str(plain),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):  # the check reads, never writes: the weights are bit-identical without msmon
        ours, theirs = torch.load(tmp_path / f"weights_rank{rank}.pt"), torch.load(plain / f"weights_rank{rank}.pt")
        assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    saved = torch.load(tmp_path / "weights_rank0.pt")
    for report in reports(tmp_path, 2):
        assert report["checks"] == 50 and report["mismatches"] == [] and report["off"] is None
        # the last check fingerprinted exactly the weights the script saved after its last step
        last = report["last_check"]
        assert last["step"] == 49
        weights = [c["name"] for c in report["checked"] if c["category"] == WEIGHT]
        expected = [f"{fingerprint(saved[name]) & (2**64 - 1):016x}" for name in weights]
        assert last["fingerprints"][-len(weights) :] == expected
    assert dump_records(tmp_path) == {}


def ds_env() -> dict[str, str]:
    return clean_env(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0")


@pytest.mark.e2e
def test_deepspeed_checks_replicated_parameters_and_skips_zero_shards(tmp_path):
    """Stage 0: every tensor is a replica and a flipped bit is caught. ZeRO-1: the model
    parameters are replicas (checked, bit-exact against what the script saved); the fp32
    partitions and reduced-gradient partitions are shards (skipped). Under ZeRO-1 the flipped
    model copy is rebuilt from the shards by the step's all-gather, so there is nothing to find."""
    config = {**CHECK, "replica_check": {"enable": True, "every": 2, "grads": True}}
    stage0, stage1 = tmp_path / "stage0", tmp_path / "stage1"
    msmon_run(
        stage0,
        2,
        config,
        "ds_replica.py",
        "--stage",
        "0",
        "--steps",
        "7",
        "--flip-step",
        "3",
        "--out",
        str(stage0),
        env=ds_env(),
    )
    assert differing_tensors(stage0, 2) == {"fc2.weight": {1}}
    for report in reports(stage0, 2):
        assert len(report["checked"]) == 8 and report["skipped"] == []
        assert [m["step"] for m in report["mismatches"]] == [4, 6]
        assert report["mismatches"][0]["tensors"] == [
            {"name": "fc2.weight", "vpp_stage": 0, "category": WEIGHT, "differing_ranks": [0, 1], "majority_ranks": []}
        ]
    msmon_run(
        stage1,
        2,
        config,
        "ds_replica.py",
        "--stage",
        "1",
        "--steps",
        "7",
        "--flip-step",
        "3",
        "--out",
        str(stage1),
        env=ds_env(),
    )
    assert differing_tensors(stage1, 2) == {}
    params = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for rank, report in enumerate(reports(stage1, 2)):
        assert report["checked"] == [{"name": n, "vpp_stage": 0, "category": WEIGHT} for n in params]
        assert sorted((s["name"], s["category"]) for s in report["skipped"]) == sorted(
            [(f"{n}[main]", WEIGHT) for n in params] + [(n, GRAD) for n in params]
        )
        assert report["checks"] == 4 and report["mismatches"] == []
        saved = torch.load(stage1 / f"weights_rank{rank}.pt")
        assert report["last_check"]["step"] == 6
        assert report["last_check"]["fingerprints"] == [f"{fingerprint(saved[n]) & (2**64 - 1):016x}" for n in params]


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["float16", "distributed"])
def test_megatron_main_copies_are_checked_and_distributed_optimizer_shards_skipped(tmp_path, case):
    """Megatron-core 0.16.1's optimizer classes on its DDP stand-in (tests/scripts/megatron_cpu.py),
    2 ranks, checked every step: Float16OptimizerWithFloat16Params keeps whole fp32 main copies
    (checked, `name[main]`) and all-reduced main_grad (checked); the DistributedOptimizer's main
    copies and gradient ranges are shards (skipped), its two model chunks' parameters are checked."""
    (tmp_path / "monitor.json").write_text(
        json.dumps({**CHECK, "replica_check": {"enable": True, "every": 1, "grads": True}})
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPTS / "megatron_cpu.py"),
            "--case",
            case,
            "--config",
            str(tmp_path / "monitor.json"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(MONITOR_OUTPUT_DIR=str(tmp_path / "out")),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    params = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for report in reports(tmp_path, 2):
        assert report["checks"] == 3 and report["mismatches"] == [] and report["off"] is None
        checked = [(c["vpp_stage"], c["name"], c["category"]) for c in report["checked"]]
        skipped = sorted((s["vpp_stage"], s["name"], s["category"]) for s in report["skipped"])
        if case == "float16":
            assert checked == [(0, n, GRAD) for n in params] + [
                (0, m, WEIGHT) for n in params for m in (n, f"{n}[main]")
            ]
            assert skipped == []
        else:
            assert checked == [(v, n, WEIGHT) for v in (0, 1) for n in params]
            assert skipped == sorted(
                [(v, n, GRAD) for v in (0, 1) for n in params]
                + [(v, f"{n}[main]", WEIGHT) for v in (0, 1) for n in params]
            )
