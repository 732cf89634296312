"""Worker functions for tests/launcher/test_launch.py, in a module that imports only torch: ``launch`` starts workers with
``spawn``, so each worker imports the module of its function, and a light one keeps the tests fast."""

import os
import signal

import torch
import torch.distributed as dist

# A worker script that joins the world and all-reduces its rank: proves the processes really form one group.
ALL_REDUCE_SCRIPT = """
import os
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(f"rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} local_world={os.environ['LOCAL_WORLD_SIZE']} "
      f"sum={int(total.item())}", flush=True)
dist.destroy_process_group()
"""


def all_reduce_ranks(scale):
    """Join the job's world; return (RANK from torchrun's environment, world size, sum of rank+1 times scale)."""
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    out = (int(os.environ["RANK"]), dist.get_world_size(), int(total.item()) * scale)
    dist.destroy_process_group()
    return out


def fail_on_rank_one(how):
    """Rank 1 dies (killed or raising) while rank 0 waits for it in a collective."""
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("rank one gave up")
    dist.barrier()  # without the agent stopping it, rank 0 would wait here for the gloo timeout (30 min)
    dist.destroy_process_group()
