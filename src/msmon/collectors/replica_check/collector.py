"""Replica check: do the data-parallel replicas still hold bit-identical weights?

Every `replica_check.every` steps, right after the optimizer step, each rank fingerprints its
replicated weights (and, with `grads`, the reduced gradients, taken before the update) on
their device (fingerprint.py: any single flipped bit changes a fingerprint). The fingerprints
go to the host in one non-blocking copy; a background thread of this rank
(runtime/exchange_thread.py) then exchanges them with the other replicas in one all_gather on
msmon's own gloo group, compares them and names the rank(s) whose copy differs from the majority
(with two replicas: both). The training thread launches kernels and a copy, nothing more; steps
that are not checked cost nothing.

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

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from ...anomaly.event import REPLICA_OP, REPLICA_RULE
from ...output.artifacts import write_artifact
from ...runtime.transfer import copy_to_host
from ...stats.fingerprint import Fingerprinter
from ..base import Collector
from ..registry import register
from .compare import Mismatch, compare
from .entries import NO_GRAD, Entry, checked, hex64, ranks_text
from .group import EXCHANGES, exchange, own_group, replica_group
from .replicas import Named, named_params, select_grads, select_weights
from .state import KEY, Job, replica_state

if TYPE_CHECKING:
    from ...runtime.step_context import StepContext

logger = logging.getLogger("msmon")

RULE, OP = REPLICA_RULE, REPLICA_OP  # the anomaly dump's rule and op of a replica disagreement
CALL_ID_BASE = 1 << 30  # after every statistic row of the step: the check runs after the update
REPORT_FILE = "replica_check.json"
FLUSH_SECONDS = 60.0  # at close, how long to wait for the last checks to be exchanged
_MAX_MISMATCHES_KEPT = 100


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
            self._named = named_params(self.ctx)
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
            EXCHANGES.append(state)
        except Exception as exc:  # gloo cannot connect, say: the check is off, training goes on
            return self._off(f"creating msmon's gloo group over ranks {ranks} failed: {exc!r}")
        state.ranks = list(dist.get_process_group_ranks(state.group))
        weights, _, skipped_w = select_weights(ctx, self.named, state.group_ranks)
        grads, _, skipped_g = select_grads(ctx, self.named, state.group_ranks) if state.settings.grads else ([], [], [])
        state.checked = [checked(e) for e in grads + weights]
        state.skipped = skipped_g + skipped_w
        state.exchange.start(
            f"msmon-replica-rank{ctx.rank}",
            ctx.rank,
            state,
            self._exchange,
            "replica check",
            "exchanging fingerprints",
            failed=self._write_report,
        )
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
        job = Job(self.ctx.step, entries, header, fps)
        job.fingerprints, job.events = copy_to_host(fps)
        self.state.exchange.put(job)

    # -- the exchange (this rank's thread: runtime/exchange_thread.py) --------------------------------
    def _exchange(self, job: Job) -> None:
        state = self.state
        for event in job.events:
            event.synchronize()
        table = exchange(torch.cat([job.header, job.fingerprints]), state.group, len(state.ranks))
        state.checks += 1
        if bool((table[:, 0] != job.step).any()) or bool((table[:, 1] != table[0, 1]).any()):
            steps = dict(zip(state.ranks, table[:, 0].tolist()))
            raise RuntimeError(f"the ranks' checks do not line up (steps {steps}, or different sets of tensors)")
        mine = table[state.ranks.index(self.ctx.rank), 2:]
        state.last = {"step": job.step, "fingerprints": [hex64(v) for v in mine.tolist()]}
        found = compare(table[:, 2:], state.ranks, job.entries)
        if found:
            self._report(job, found)
        else:
            self._write_report()

    def _report(self, job: Job, found: list[Mismatch]) -> None:
        ctx, state = self.ctx, self.state
        rank = ctx.rank
        mine = [m for m in found if rank in m.differing]
        listed = "; ".join(m.describe() for m in found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
        verdict = "this rank's copy differs" if mine else "this rank holds the majority copy"
        # a divergence persists: the first check that finds these tensors differing is logged, later ones counted
        names = ", ".join(m.entry.name for m in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        key = (RULE, tuple((m.entry.name, m.entry.category, tuple(m.differing)) for m in found))
        kept = "replica_check.json lists every one" + ("; the anomaly dump too" if mine else "")
        if ctx.alert_repeats.first(key, RULE, f"the replicas of {names}", job.step, "checks", kept):
            logger.error(
                "msmon[rank %d]: replica check at step %d: %d of %d tensors differ across data-parallel %s: %s; %s",
                rank,
                job.step,
                len(found),
                len(job.entries),
                ranks_text(state.ranks),
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
            "fingerprints": {str(r): hex64(v) for r, v in m.values.items()},
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
        try:
            with state.lock:
                write_artifact(ctx.log_dir, REPORT_FILE, json.dumps(data, indent=1))
        except OSError as exc:
            path = os.path.join(ctx.log_dir, REPORT_FILE)
            logger.warning("msmon[rank %d]: could not write %s: %s", ctx.rank, path, exc)

    def _flush(self) -> None:
        state = self.state
        if state.exchange.thread is None:
            return
        left = state.exchange.flush(FLUSH_SECONDS)
        if left:
            logger.warning(
                "msmon[rank %d]: %d replica check(s) still waiting for the other ranks after %.0f s; not reported",
                self.ctx.rank,
                left,
                FLUSH_SECONDS,
            )
        self._write_report()
