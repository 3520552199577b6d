"""`ragged_gather` in 2 processes (gloo on CPU) over accelerate's own sharded dataloader: 5 rows holding 3, 1, 2, 4
and 2 pairs, 2 rows per process per batch, so the last batch is evened out with 3 rows repeated from the start
(accelerate's remainder is 1 row). The metrics' gathers see every pair exactly once, in the per-pair layout, in
TRL's chosen-then-rejected [2B] layout, one value per row (the evaluation loop's loss) and as one scalar per process; accelerate's own cut counted rows as pairs.

The trainer's side (which micro-batch is the last, the collators' `row_units`) is a stand-in here: the loop sets
`last_rows` as `step_weights.PairTrainer` does; tests/test_step_weights.py's 2-process runs check it end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import json, sys
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from erniekit_lite import launch
from erniekit_lite.train import ragged_gather

UNITS = [3, 1, 2, 4, 2]
accelerator = Accelerator(cpu=True)
loader = accelerator.prepare(DataLoader(list(range(len(UNITS))), batch_size=2, collate_fn=list))
last = {"rows": None}
ragged_gather.install(accelerator, lambda: last["rows"])
seen = {"pairs": [], "chosen_rejected": [], "rows": [], "scalars": [], "plain": []}
for rows in loader:
    ids = torch.tensor([10 * r + k for r in rows for k in range(UNITS[r])])
    last["rows"] = [UNITS[r] for r in rows] if accelerator.gradient_state.end_of_dataloader else None
    seen["pairs"] += accelerator.gather_for_metrics(ids).tolist()
    seen["chosen_rejected"] += accelerator.gather_for_metrics(torch.cat([ids, -ids])).tolist()
    seen["rows"] += accelerator.gather_for_metrics(torch.tensor(rows)).tolist()  # one value per row: the eval loop's loss
    seen["scalars"].append(accelerator.gather_for_metrics(torch.tensor(len(rows))).tolist())
    seen["plain"] += accelerator.gather(ids).tolist()  # training's own gathers: every row, repeats included
if accelerator.is_main_process:
    print("SEEN " + json.dumps(seen))
launch.end_process_group()  # else gloo's threads may abort the exit
"""


def test_metrics_gather_each_pair_once_at_a_dataloader_end_in_two_processes(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    import json

    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("SEEN "))[5:])
    units = [3, 1, 2, 4, 2]
    every = [10 * r + k for r in range(5) for k in range(units[r])]
    # batch 1: process 0 rows 0, 1; process 1 rows 2, 3. Batch 2: process 0 rows 4, 0 (a repeat); process 1 rows 1, 2
    assert seen["pairs"] == every
    assert seen["chosen_rejected"] == [0, 1, 2, 10, 0, -1, -2, -10, 20, 21, 30, 31, 32, 33, -20, -21, -30, -31, -32, -33,
                                       40, 41, -40, -41]
    assert seen["rows"] == [0, 1, 2, 3, 4]
    assert seen["scalars"] == [[2, 2], [2]]  # the last batch: process 1 holds only repeats
    assert sorted(seen["plain"]) == sorted(every + [0, 1, 2, 10, 20, 21])
