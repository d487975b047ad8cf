"""Two gloo ranks: where does each rank sit in the pipeline, for several process groups?
Writes position_rank{r}.json into argv[1]. Run with torchrun --nproc-per-node 2."""

import json
import os
import sys

import torch
import torch.distributed as dist

from msmon import TrainerMon
from msmon.seams.pipeline import pipeline_position

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
pair = dist.new_group([0, 1])
singles = [dist.new_group([0]), dist.new_group([1])]
seen = {
    "none": pipeline_position(None),
    "pair": pipeline_position(pair),
    "own": pipeline_position(singles[rank]),
    "foreign": pipeline_position(singles[1 - rank]),
}
config = os.path.join(out, f"monitor_rank{rank}.json")
with open(config, "w") as fh:
    json.dump({"format": "csv"}, fh)
os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out, "monitor_output")
model = torch.nn.Linear(2, 2)
mon = TrainerMon(config, process_group=pair)
mon.set_monitor(model, torch.optim.SGD(model.parameters(), lr=0.1))
seen["monitor"] = (mon.pp_stage, mon.group_mates)
mon.close()
with open(os.path.join(out, f"position_rank{rank}.json"), "w") as fh:
    json.dump(seen, fh)
dist.destroy_process_group()
