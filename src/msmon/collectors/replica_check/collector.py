"""Replica check: do the data-parallel replicas still hold bit-identical weights?

Every `replica_check.every` steps, right after the optimizer step, each rank fingerprints its
replicated weights (and, with `grads`, the reduced gradients, taken before the update) on
their device (fingerprint.py: any single flipped bit changes a fingerprint). The fingerprints
go to the host in one non-blocking copy; a background thread of this rank then exchanges them
with the other replicas in one all_gather on msmon's own gloo group, compares them and names
the rank(s) whose copy differs from the majority (with two replicas: both). The training
thread launches kernels and a copy, nothing more; steps that are not checked cost nothing.

Replicated means the same tensor on every rank of the data-parallel group: the model's
parameters under DDP, DeepSpeed stage 0-2 and Megatron; whole fp32 main copies where the
optimizer keeps them (DeepSpeed's FP16_UnfusedOptimizer, Megatron's Float16Optimizer);
reduced gradients where they are whole. Pieces of a tensor split across the group (ZeRO
partitions, distributed-optimizer shards, ZeRO-3 parameters, FSDP without replication) are not
replicas and are skipped, and so are MoE expert parameters (`allreduce=False`: replicated over
a smaller group). Under HSDP a parameter is split across a shard group and each piece copied
across a replicate group: the optimizer's adapter declares that group (`replica_group(p)`, the
check's group then) and this rank's piece (the Shard its weight and gradient are), and the
piece is compared across it, as "this rank's shard" of the tensor.
`replica_check.json` in each rank's output directory lists what was checked
and skipped, and every check's outcome.

The data-parallel group is the one msmon already knows (dedupe.discover: set_monitor's
dp_group, the optimizer's (HSDP's replicate group), a DeepSpeed engine's, Megatron's), else the
group the adapter declares for a parameter's copies (FSDP1 NO_SHARD units), else a
DistributedDataParallel module's process group; without one there is nothing to compare and the
check is off. A parameter whose declared copies lie across another group is skipped (one group
per check).
`replica_check` is read when the monitor attaches; edits to it while training runs are ignored,
so every rank keeps checking the same steps.
"""

from __future__ import annotations

import gc
import hashlib
import inspect
import json
import logging
import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch
import torch.distributed as dist

from ... import dedupe
from ...anomaly.rules import REPLICA_OP, REPLICA_RULE
from ...fingerprint import Fingerprinter
from ...optimizers.base import Shard
from ...system import exit_drain
from ...system.torch_threads import torch_on_this_thread_only
from ...transfer import copy_to_host
from ..base import Collector
from ..registry import register

if TYPE_CHECKING:
    from ...config import ReplicaCheckConfig
    from ...step_context import StepContext

logger = logging.getLogger("msmon")

KEY = "replica_check"

RULE, OP = REPLICA_RULE, REPLICA_OP  # the anomaly dump's rule and op of a replica disagreement
CALL_ID_BASE = 1 << 30  # after every statistic row of the step: the check runs after the update
NO_GRAD = -(1 << 63)  # the fingerprint slot of a parameter without a gradient on this rank
REPORT_FILE = "replica_check.json"
GATHER_TIMEOUT = timedelta(minutes=10)
FLUSH_SECONDS = 60.0  # at close, how long to wait for the last checks to be exchanged
WEIGHT, GRAD = "param_updated", "grad_reduced"
WHAT = {WEIGHT: "weight after the update", GRAD: "reduced gradient before the update"}
_MAX_MISMATCHES_KEPT = 100
_OWN_GROUPS: dict[tuple, Any] = {}
_EXCHANGES: list[ReplicaState] = []  # the states whose exchange threads use msmon's groups


@dataclass(frozen=True)
class Entry:
    """One fingerprinted tensor: its name, model chunk and what it is (a `category`)."""

    name: str
    vpp_stage: int
    category: str
    shard: bool = False  # this rank's piece of a parameter split across ranks (HSDP), not the whole

    @property
    def label(self) -> str:
        """The name, with its model chunk when that is not the first (`1:fc1.weight`)."""
        return f"{self.vpp_stage}:{self.name}" if self.vpp_stage else self.name

    @property
    def what(self) -> str:
        """What was compared, for the alert: `weight after the update`, `this rank's shard; ...`."""
        return f"this rank's shard; {WHAT[self.category]}" if self.shard else WHAT[self.category]


class _Tensor(TypedDict):
    name: str
    vpp_stage: int
    category: str


class CheckedTensor(_Tensor, total=False):
    """A tensor the check fingerprints, as replica_check.json lists it (`shard`: true for this
    rank's piece of a split parameter, compared across the ranks holding the same piece)."""

    shard: bool


class SkippedTensor(CheckedTensor):
    """A tensor left out, and why it is not a replica."""

    why: str


@dataclass
class Mismatch:
    """One tensor whose fingerprints differ across the group."""

    entry: Entry
    differing: list[int]  # global ranks whose copy differs from the majority (all, without one)
    majority: list[int]  # global ranks holding the majority copy (empty: no majority)
    values: dict[int, int]  # global rank -> fingerprint

    def describe(self) -> str:
        what = f"{self.entry.label} ({self.entry.what})"
        if self.majority:
            verb = "differs" if len(self.differing) == 1 else "differ"
            text = f"{what}: {_ranks(self.differing)} {verb} from the majority ({_ranks(self.majority)})"
        else:
            copies = " vs ".join("{" + ", ".join(map(str, g)) + "}" for g in _copies(self.values))
            text = f"{what}: {_ranks(self.differing)} hold different copies and none has a majority (copies {copies})"
        missing = [r for r, v in self.values.items() if v == NO_GRAD]
        if missing:
            text += f"; {_ranks(missing)} {'has' if len(missing) == 1 else 'have'} no gradient"
        return text


def compare(table: torch.Tensor, ranks: list[int], entries: list[Entry]) -> list[Mismatch]:
    """The tensors whose fingerprints differ: `table` is int64 [ranks, tensors] on the host (row i
    from ranks[i]). The majority copy is the one more than half the ranks hold; without one,
    every rank is named."""
    out: list[Mismatch] = []
    if table.shape[0] < 2:
        return out
    for j in (table != table[0]).any(dim=0).nonzero().flatten().tolist():
        column = table[:, j].tolist()
        by_rank = dict(zip(ranks, column))
        top, count = max(((v, column.count(v)) for v in set(column)), key=lambda item: item[1])
        if count * 2 > len(ranks):
            majority = [r for r, v in by_rank.items() if v == top]
            differing = [r for r in ranks if r not in majority]
        else:
            majority, differing = [], list(ranks)
        out.append(Mismatch(entries[j], differing, majority, by_rank))
    return out


def _hex(value: int) -> str:
    """A fingerprint as 16 hex digits (its 64 bits, unsigned)."""
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}"


def _copies(values: dict[int, int]) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    return sorted(groups.values())


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in sorted(ranks)[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


# -- which tensors are replicas ------------------------------------------------------------------
def _named_params(ctx: StepContext) -> list[tuple[str, int, torch.Tensor]]:
    """(display name, model chunk, parameter) of every parameter the optimizer trains, in its order."""
    _, params = ctx.names()
    where: dict[int, tuple[str, int]] = {}
    for chunk, named in enumerate(params):
        for name, p in named.items():
            where.setdefault(id(p), (name, chunk))
    out = []
    for i, p in enumerate(ctx.adapter.params()):
        name, chunk = where.get(id(p), (f"param[{i}]", 0))
        out.append((name, chunk, p))
    return out


Named = list[tuple[str, int, torch.Tensor]]


class DeclaredCopies:
    """The ranks the adapter declares hold copies of this rank's piece of a parameter (its
    `replica_group`: HSDP's replicate group), looked up once per group; `group_ranks` are the
    ranks of the check's group (None: not known yet, anything goes)."""

    def __init__(self, adapter: Any, group_ranks: list[int] | None) -> None:
        self.adapter = adapter
        self.group_ranks = sorted(group_ranks) if group_ranks is not None else None
        self._ranks: dict[int, list[int]] = {}

    def of(self, param: torch.Tensor) -> list[int] | None:
        group = self.adapter.replica_group(param)
        if group is None:
            return None
        found = self._ranks.get(id(group))
        if found is None:
            found = self._ranks[id(group)] = sorted(dist.get_process_group_ranks(group))
        return found

    def elsewhere(self, ranks: list[int]) -> str | None:
        """Why copies across `ranks` cannot be compared in this check (None: they can)."""
        if self.group_ranks is None or ranks == self.group_ranks:
            return None
        return (
            f"its copies lie across {_ranks(ranks)}, not the check's group ({_ranks(self.group_ranks)}): "
            "one group per check"
        )


def _declared(
    copies: DeclaredCopies, p: torch.Tensor, value: Any
) -> tuple[str | None, bool, torch.Tensor | None] | None:
    """What the adapter declares of `p`: (why skipped, whether a shard, the tensor to fingerprint),
    or None when it declares nothing (the other rules apply)."""
    held = copies.of(p)
    if held is not None:
        why = copies.elsewhere(held)
        if isinstance(value, Shard):
            return why, True, value.local
        return why, False, value
    why = copies.adapter.unreplicated(p)
    return (why, False, None) if why is not None else None


def select_weights(
    ctx: StepContext, named: Named | None = None, group_ranks: list[int] | None = None
) -> tuple[list[Entry], list[torch.Tensor], list[SkippedTensor]]:
    """The replicated weights (model parameters, whole main copies, the pieces the adapter
    declares copied across the check's group `group_ranks`), and what was skipped and why."""
    named = _named_params(ctx) if named is None else named
    not_a_replica = dedupe.replica_exclusion(ctx.models, ctx.adapter.optimizer, weights=True)
    mains = ctx.adapter.own_weights([p for _, _, p in named])
    copies = DeclaredCopies(ctx.adapter, group_ranks)
    entries: list[Entry] = []
    tensors: list[torch.Tensor] = []
    skipped: list[SkippedTensor] = []
    for name, chunk, p in named:
        main = mains.get(id(p))
        declared = _declared(copies, p, p if main is None else main)
        if declared is not None:
            why, shard, tensor = declared
            if why is not None or tensor is None:
                skipped.append({"name": name, "vpp_stage": chunk, "category": WEIGHT, "why": why or "no weight"})
            else:
                entries.append(Entry(name, chunk, WEIGHT, shard))
                tensors.append(tensor)
            continue
        why = not_a_replica(p)
        if why is None:
            entries.append(Entry(name, chunk, WEIGHT))
            tensors.append(p)
        else:
            skipped.append({"name": name, "vpp_stage": chunk, "category": WEIGHT, "why": why})
        if main is None or main is p:
            continue
        label = f"{name}[main]"
        if isinstance(main, Shard) or callable(getattr(main, "to_local", None)):
            skipped.append(
                {
                    "name": label,
                    "vpp_stage": chunk,
                    "category": WEIGHT,
                    "why": "this rank's piece of the fp32 main copy, split across the data-parallel ranks",
                }
            )
        else:
            entries.append(Entry(label, chunk, WEIGHT))
            tensors.append(main)
    return entries, tensors, skipped


def select_grads(
    ctx: StepContext, named: Named | None = None, group_ranks: list[int] | None = None
) -> tuple[list[Entry], list[torch.Tensor | None], list[SkippedTensor]]:
    """The reduced gradients that are whole on every rank, and the pieces the adapter declares
    copied across the check's group (None: no gradient on this rank)."""
    named = _named_params(ctx) if named is None else named
    grads = ctx.adapter.own_grads([p for _, _, p in named], ctx.grad_of)
    not_a_replica = dedupe.replica_exclusion(ctx.models, ctx.adapter.optimizer, weights=False)
    copies = DeclaredCopies(ctx.adapter, group_ranks)
    entries: list[Entry] = []
    tensors: list[torch.Tensor | None] = []
    skipped: list[SkippedTensor] = []
    for name, chunk, p in named:
        g = grads.get(id(p))
        declared = _declared(copies, p, g)
        if declared is not None:
            why, shard, tensor = declared
            if why is not None:
                skipped.append({"name": name, "vpp_stage": chunk, "category": GRAD, "why": why})
            else:
                entries.append(Entry(name, chunk, GRAD, shard))
                tensors.append(tensor)
            continue
        why = not_a_replica(p)
        if why is None and isinstance(g, Shard):
            why = "this rank's piece of the reduced gradient, split across the data-parallel ranks"
        if why is None and g is not None and callable(getattr(g, "to_local", None)):
            why = "a DTensor (FSDP2): each rank holds its own shard"
        if why is not None:
            skipped.append({"name": name, "vpp_stage": chunk, "category": GRAD, "why": why})
            continue
        entries.append(Entry(name, chunk, GRAD))
        tensors.append(g)
    return entries, tensors, skipped


# -- the group ------------------------------------------------------------------------------------
def replica_group(ctx: StepContext) -> Any:
    """The data-parallel group of this rank's replicas, or None when none is known."""
    groups = dedupe.discover(ctx.models, ctx.adapter, ctx.dp_group, ctx.tp_group)
    if groups.dp is not None:
        return groups.dp
    for p in ctx.adapter.params():  # the copies an adapter declares (FSDP1 NO_SHARD units)
        declared = ctx.adapter.replica_group(p)
        if declared is not None:
            return declared
    return _ddp_group(ctx)


def _ddp_group(ctx: StepContext) -> Any:
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
    except ImportError:
        return None
    owned = {id(p) for p in ctx.adapter.params()}
    for chunk in ctx.models:
        for m in chunk.modules():
            if isinstance(m, DDP):
                return getattr(m, "process_group", None) or dist.group.WORLD
    # the monitor may hold the bare model that DDP wrapped afterwards: look for that DDP once
    for obj in gc.get_objects():
        if issubclass(type(obj), DDP) and any(id(p) in owned for p in obj.parameters()):
            return getattr(obj, "process_group", None) or dist.group.WORLD
    return None


def own_group(ranks: list[int]) -> Any:
    """msmon's own gloo group over `ranks` (made once per set of ranks; only its members take
    part), so the exchange never queues behind the training's collectives or streams."""
    key = (id(dist.distributed_c10d._get_default_group()), tuple(ranks))
    group = _OWN_GROUPS.get(key)
    if group is None:
        options: dict[str, Any] = {"backend": "gloo", "timeout": GATHER_TIMEOUT, "use_local_synchronization": True}
        if "group_desc" in inspect.signature(dist.new_group).parameters:  # torch >= 2.3
            options["group_desc"] = "msmon_replica_check"
        group = _OWN_GROUPS[key] = dist.new_group(sorted(ranks), **options)
        exit_drain.at_drain(_release_own_groups)
    return group


def _release_own_groups() -> None:
    """At exit, while the interpreter is whole: destroy msmon's groups, unless an exchange is
    still on its way (a check the other ranks never joined keeps its group)."""
    if any(state.jobs.unfinished_tasks for state in _EXCHANGES):
        return
    for state in _EXCHANGES:
        state.group = None
    for key in list(_OWN_GROUPS):
        exit_drain.destroy_group(_OWN_GROUPS.pop(key))


def exchange(payload: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[size, len(payload)]: every member's payload, in group-rank order, by one all_gather
    through torch's own function (under cc_distribution msmon's wrapper would count msmon's
    exchange as the training's communication)."""
    gathered = [torch.empty_like(payload) for _ in range(size)]
    all_gather = getattr(dist.all_gather, "__msmon_original__", dist.all_gather)
    exit_drain.hold(all_gather(gathered, payload, group=group, async_op=True)).wait()  # held: exit_drain.py
    return torch.stack(gathered)


# -- the check ------------------------------------------------------------------------------------
@dataclass
class _Job:
    step: int
    entries: list[Entry]
    header: torch.Tensor  # int64 [step, layout digest] on the host
    fingerprints: torch.Tensor  # int64, on the host (filled by a non-blocking copy until `events` complete)
    events: list[Any] = field(default_factory=list)


@dataclass
class ReplicaState:
    """What survives the monitor's collector rebuilds: the settings read at attach, the group,
    the exchange thread, the outcome so far."""

    settings: ReplicaCheckConfig
    off: str | None = None  # why the check is off, once it is
    group: Any = None
    ranks: list[int] = field(default_factory=list)
    group_ranks: list[int] = field(default_factory=list)  # the data-parallel group's ranks, module_ranks or not
    resolved: bool = False
    checks: int = 0
    last: dict[str, Any] | None = None  # this rank's fingerprints at the last check, as hex
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    checked: list[CheckedTensor] = field(default_factory=list)
    skipped: list[SkippedTensor] = field(default_factory=list)
    jobs: queue.Queue[_Job] = field(default_factory=queue.Queue)
    thread: threading.Thread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # the report file, written from both threads
    warned_edit: bool = False


def _checked(entry: Entry) -> CheckedTensor:
    out: CheckedTensor = {"name": entry.name, "vpp_stage": entry.vpp_stage, "category": entry.category}
    if entry.shard:
        out["shard"] = True
    return out


def replica_state(ctx: StepContext) -> ReplicaState:
    """The monitor's replica check state, made with the settings it had when it attached (kept in
    ctx.kept across collector rebuilds: every rank must keep checking the same steps)."""
    state: ReplicaState | None = ctx.kept.get(KEY)
    current = ctx.config.replica_check
    if state is None:
        state = ctx.kept[KEY] = ReplicaState(settings=current)
    elif current != state.settings and not state.warned_edit:
        state.warned_edit = True
        logger.warning(
            "msmon[rank %d]: replica_check was edited during the run; the edit takes effect in the next "
            "run (every rank must keep checking the same steps)",
            ctx.rank,
        )
    return state


@register(key=KEY, category="check", order=120, enabled=lambda cfg, ctx: replica_state(ctx).settings.enable)
class ReplicaCheckCollector(Collector):
    name = "replica check"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self.state = replica_state(ctx)
        self.fingerprint = Fingerprinter()
        self._grads: tuple[int, list[Entry], torch.Tensor] | None = None
        self._named: Named | None = None

    @property
    def named(self) -> Named:
        """The optimizer's parameters with their names, found once (the names walk the whole model)."""
        if self._named is None:
            self._named = _named_params(self.ctx)
        return self._named

    # -- step callbacks (training thread) ------------------------------------------------------
    def _due(self) -> bool:
        state = self.state
        return state.off is None and self.ctx.step % state.settings.every == 0 and self._resolve()

    def before_update(self) -> None:
        if self.state.settings.grads and self._due():
            entries, tensors, _ = select_grads(self.ctx, self.named, self.state.group_ranks)
            self._grads = (self.ctx.step, entries, self._fingerprints(tensors))

    def after_update(self) -> None:
        if not self._due():
            return
        entries, tensors, _ = select_weights(self.ctx, self.named, self.state.group_ranks)
        fps = self._fingerprints(tensors)
        grads, self._grads = self._grads, None
        if grads is not None and grads[0] == self.ctx.step:
            entries = grads[1] + entries
            fps = torch.cat([grads[2].to(fps.device), fps])
        self._submit(entries, fps)

    def detach(self) -> None:
        """Wait (a bounded time) for the checks still being exchanged, and report them."""
        super().detach()
        self._flush()

    # -- setup, once ----------------------------------------------------------------------------
    def _resolve(self) -> bool:
        state = self.state
        if state.resolved:
            return state.off is None
        state.resolved = True
        ctx = self.ctx
        if not (dist.is_available() and dist.is_initialized()):
            return self._off("torch.distributed is not initialised: there are no replicas to compare", info=True)
        group = replica_group(ctx)
        if group is None and self._unreplicated():
            return False
        if group is None:
            return self._off(
                "no data-parallel group is known (no DDP module, no DeepSpeed or Megatron group, no "
                "dp_group given to set_monitor): nothing to compare",
                info=True,
            )
        ranks = list(dist.get_process_group_ranks(group))
        state.group_ranks = list(ranks)
        if ctx.config.module_ranks:  # ranks outside module_ranks run no collector: leave them out
            ranks = [r for r in ranks if r in set(ctx.config.module_ranks)]
        if len(ranks) < 2 or ctx.rank not in ranks:
            return self._off(
                f"the data-parallel group has {len(ranks)} recording rank(s): nothing to compare", info=True
            )
        try:
            state.group = own_group(ranks)
            _EXCHANGES.append(state)
        except Exception as exc:  # gloo cannot connect, say: the check is off, training goes on
            return self._off(f"creating msmon's gloo group over ranks {ranks} failed: {exc!r}")
        state.ranks = list(dist.get_process_group_ranks(state.group))
        weights, _, skipped_w = select_weights(ctx, self.named, state.group_ranks)
        grads, _, skipped_g = select_grads(ctx, self.named, state.group_ranks) if state.settings.grads else ([], [], [])
        state.checked = [_checked(e) for e in grads + weights]
        state.skipped = skipped_g + skipped_w
        state.thread = threading.Thread(target=self._exchange_loop, name=f"msmon-replica-rank{ctx.rank}", daemon=True)
        state.thread.start()
        logger.info(
            "msmon[rank %d]: replica check every %d steps over data-parallel ranks %s: %d tensors, %d skipped "
            "(not replicas)",
            ctx.rank,
            state.settings.every,
            state.ranks,
            len(state.checked),
            len(state.skipped),
        )
        self._write_report()
        return True

    def _unreplicated(self) -> bool:
        """Whether every parameter is split with no copy of this rank's piece anywhere (FSDP
        without replication): then the check is off, and replica_check.json says why of each."""
        ctx, state = self.ctx, self.state
        weights, _, skipped_w = select_weights(ctx, self.named)
        grads, _, skipped_g = select_grads(ctx, self.named) if state.settings.grads else ([], [], [])
        declared = [ctx.adapter.unreplicated(p) for _, _, p in self.named]
        if weights or grads or not declared or None in declared:
            return False
        state.skipped = skipped_g + skipped_w
        self._off(
            "no tensor has a copy on another rank: every parameter is split across ranks and no rank holds a "
            f"copy of this rank's piece (FSDP without a replicate dimension); {len(state.skipped)} tensors "
            "skipped, each with why, in " + REPORT_FILE,
            info=True,
        )
        self._write_report()
        return True

    def _off(self, reason: str, info: bool = False) -> bool:
        self.state.off = reason
        (logger.info if info else logger.error)("msmon[rank %d]: replica check off: %s", self.ctx.rank, reason)
        return False

    # -- on the device ---------------------------------------------------------------------------
    def _fingerprints(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        present = [i for i, t in enumerate(tensors) if t is not None]
        if not present:
            return torch.full((len(tensors),), NO_GRAD, dtype=torch.int64)
        fps = self.fingerprint(cast("list[torch.Tensor]", [tensors[i] for i in present]))  # `present`: not None
        if len(present) == len(tensors):
            return fps
        full = torch.full((len(tensors),), NO_GRAD, dtype=torch.int64, device=fps.device)
        return full.index_copy_(0, self.fingerprint.positions(fps.device, present), fps)

    def _submit(self, entries: list[Entry], fps: torch.Tensor) -> None:
        """Start the copy to the host and hand the exchange to this rank's thread."""
        layout = hashlib.blake2b(repr([(e.name, e.category) for e in entries]).encode(), digest_size=8).digest()
        header = torch.tensor([self.ctx.step, int.from_bytes(layout, "little", signed=True)], dtype=torch.int64)
        job = _Job(self.ctx.step, entries, header, fps)
        job.fingerprints, job.events = copy_to_host(fps)
        self.state.jobs.put(job)

    # -- the exchange (this rank's thread) -----------------------------------------------------------
    def _exchange_loop(self) -> None:
        torch_on_this_thread_only()  # a team of its own would slow every parallel op of the training
        state = self.state
        while True:
            job = state.jobs.get()
            try:
                if state.off is None:
                    self._exchange(job)
            except Exception as exc:  # contained: the check stops, training goes on
                state.off = f"exchanging fingerprints failed: {exc!r}"
                logger.error(
                    "msmon[rank %d]: replica check at step %d failed and is switched off; training continues: %r",
                    self.ctx.rank,
                    job.step,
                    exc,
                )
                self._write_report()
            finally:
                state.jobs.task_done()

    def _exchange(self, job: _Job) -> None:
        state = self.state
        for event in job.events:
            event.synchronize()
        table = exchange(torch.cat([job.header, job.fingerprints]), state.group, len(state.ranks))
        state.checks += 1
        if bool((table[:, 0] != job.step).any()) or bool((table[:, 1] != table[0, 1]).any()):
            steps = dict(zip(state.ranks, table[:, 0].tolist()))
            raise RuntimeError(f"the ranks' checks do not line up (steps {steps}, or different sets of tensors)")
        mine = table[state.ranks.index(self.ctx.rank), 2:]
        state.last = {"step": job.step, "fingerprints": [_hex(v) for v in mine.tolist()]}
        found = compare(table[:, 2:], state.ranks, job.entries)
        if found:
            self._report(job, found)
        else:
            self._write_report()

    def _report(self, job: _Job, found: list[Mismatch]) -> None:
        ctx, state = self.ctx, self.state
        rank = ctx.rank
        mine = [m for m in found if rank in m.differing]
        listed = "; ".join(m.describe() for m in found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
        verdict = "this rank's copy differs" if mine else "this rank holds the majority copy"
        logger.error(
            "msmon[rank %d]: replica check at step %d: %d of %d tensors differ across data-parallel %s: %s; %s",
            rank,
            job.step,
            len(found),
            len(job.entries),
            _ranks(state.ranks),
            listed,
            verdict,
        )
        state.mismatches.append(
            {
                "step": job.step,
                "tensors": [
                    {
                        "name": m.entry.name,
                        "vpp_stage": m.entry.vpp_stage,
                        "category": m.entry.category,
                        "differing_ranks": m.differing,
                        "majority_ranks": m.majority,
                        **({"shard": True} if m.entry.shard else {}),
                    }
                    for m in found
                ],
            }
        )
        del state.mismatches[:-_MAX_MISMATCHES_KEPT]
        dump = ctx.anomaly_dump()
        if dump is not None and mine:
            index = {e: j for j, e in enumerate(job.entries)}
            try:
                dump.append(self._record(job.step, m, index[m.entry]) for m in mine)
            except OSError as exc:
                logger.error("msmon[rank %d]: writing the replica mismatch to the anomaly dump failed: %s", rank, exc)
        self._write_report()

    def _record(self, step: int, m: Mismatch, position: int) -> dict[str, Any]:
        """An anomaly-dump record (anomaly/dump.py's fields, and who differs from whom)."""
        return {
            "step": step,
            "micro_step": None,
            "vpp_stage": m.entry.vpp_stage,
            "stage": "optimizer",
            "call_id": CALL_ID_BASE + position,
            "name": m.entry.name,
            "category": m.entry.category,
            "op": OP,
            "value": float(len(m.differing)),
            "history": None,
            "rule": RULE,
            "message": f"replica check: {m.describe()}",
            "group_ranks": self.state.ranks,
            "differing_ranks": m.differing,
            "majority_ranks": m.majority,
            "fingerprints": {str(r): _hex(v) for r, v in m.values.items()},
        }

    def _write_report(self) -> None:
        """replica_check.json in the rank's output directory: coverage and outcome so far."""
        ctx, state = self.ctx, self.state
        if ctx.log_dir is None:
            return
        data = {
            "every": state.settings.every,
            "grads": state.settings.grads,
            "group_ranks": state.ranks,
            "off": state.off,
            "checks": state.checks,
            "checked": state.checked,
            "skipped": state.skipped,
            "mismatches": state.mismatches,
            "last_check": state.last,
        }
        path = os.path.join(ctx.log_dir, REPORT_FILE)
        try:
            with state.lock:
                with open(path + ".tmp", "w", encoding="utf-8") as fh:
                    json.dump(data, fh, indent=1)
                os.replace(path + ".tmp", path)
        except OSError as exc:
            logger.warning("msmon[rank %d]: could not write %s: %s", ctx.rank, path, exc)

    def _flush(self) -> None:
        state = self.state
        if state.thread is None:
            return
        jobs = state.jobs
        with jobs.all_tasks_done:
            if jobs.unfinished_tasks and not jobs.all_tasks_done.wait_for(
                lambda: not jobs.unfinished_tasks, FLUSH_SECONDS
            ):
                logger.warning(
                    "msmon[rank %d]: %d replica check(s) still waiting for the other ranks after %.0f s; not reported",
                    self.ctx.rank,
                    jobs.unfinished_tasks,
                    FLUSH_SECONDS,
                )
        self._write_report()
