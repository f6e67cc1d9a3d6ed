"""The torch CP wrapper's NCCL code paths on one GPU (a one-rank NCCL group).

    python3 scripts/gpu/check_cp_one_rank.py      # seconds; the two-GPU check is check_cp.py

The cross-rank input check, the all-gather into one tensor and the reduce-scatter of
dK/dV run as on several GPUs, against the torch reference (out, dq, dk, dv); then a
refused input (float routes) must raise TypeError. Prints NCCL_CP_OK or NCCL_CP_FAIL.
"""
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
path = tempfile.mktemp()
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
from qsa_torch import reference_sparse_gqa_attention as ref
from qsa_torch.context_parallel import context_parallel_sparse_gqa_attention as cp
from qsa_torch.context_parallel import gather_sequence

g = torch.Generator(device="cuda").manual_seed(0)
shapes = ((2, 64, 4, 32), (2, 64, 2, 32), (2, 64, 2, 32), (2, 64, 4, 32))
q, k, v, do = (torch.randn(s, device="cuda", generator=g) for s in shapes)
routes = torch.randint(-1, 64, (2, 64, 9), device="cuda", generator=g)
res = {}
for name, fn in (("cp", lambda a, b, c: cp(a, b, c, routes, 0.3)), ("ref", lambda a, b, c: ref(a, b, c, routes, 0.3))):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(do)
    res[name] = [out.detach(), *(x.grad for x in leaves)]
errs = [float((a - b).norm() / b.norm()) for a, b in zip(res["cp"], res["ref"])]
print("nccl world-1 cp vs reference (out, dq, dk, dv):", [f"{e:.2e}" for e in errs])
gathered = bool(torch.equal(gather_sequence(k, dim=1), k))
print("gather_sequence equal:", gathered)
try:
    cp(q, k, v, routes.float(), 0.3)
    refused = False
except TypeError:
    refused = True
print("float routes refused with TypeError:", refused)
dist.destroy_process_group()
print("NCCL_CP_OK" if max(errs) < 1e-5 and gathered and refused else "NCCL_CP_FAIL")
