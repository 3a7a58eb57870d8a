"""A task of a Slurm job step (tests/test_multinode.py): takes its rank, the master's address and
port from tupe_ds.distributed.launch as tupe-pretrain does, meets the step's other tasks over gloo
(an all-reduce of rank + 1), and prints one JSON line of what it used and the CPUs it may run on."""

import command_start  # noqa: F401  (first: starts as a tupe_ds command)
import datetime
import json
import os
import shutil
import socket

import torch
import torch.distributed as dist

from tupe_ds.distributed import launch
from tupe_ds.tools import startup

startup.resume_collector()
launcher = launch.discover()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
print(json.dumps({"launcher": launcher, "rank": dist.get_rank(), "host": socket.gethostname(),
                  "node": os.environ["SLURMD_NODENAME"],
                  "master": [os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])],
                  "sum": total.item(), "scontrol": shutil.which("scontrol"),
                  "cpus": sorted(os.sched_getaffinity(0)),
                  "srun_cpus_per_task": os.environ.get("SRUN_CPUS_PER_TASK")}), flush=True)
dist.destroy_process_group()
