"""Tensor-parallel generation with a 20% H2O cache: each rank holds half the KV heads and their eviction state.

    torchrun --nproc-per-node 2 examples/tp_generate.py          # CPU, gloo: one thread per rank
    python examples/tp_generate.py                               # one process, for comparison

Every rank runs this whole script with the same model and prompt; ``optimize(..., tp=True)`` shards the model
over the default process group before capturing it, and every rank returns the same tokens. On GPUs, init the
group with "nccl" and move the model to ``cuda:LOCAL_RANK`` first.
"""

import datetime
import os

import torch
import torch.distributed as dist

import h2o_compile
from h2o_compile.zoo import load_tiny

distributed = "WORLD_SIZE" in os.environ  # set by torchrun
if distributed:
    # A timeout makes a rank whose peer died raise instead of waiting forever in an all-reduce.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
rank = dist.get_rank() if distributed else 0

model, tokenizer = load_tiny()  # 8 query / 2 KV heads: 1 KV head per rank at N = 2
opt = h2o_compile.optimize(model, budget=0.2, tp=distributed)

tokenizer.padding_side = "left"
prompts = ["The history of the city begins in the twelfth century, when", "Natasha looked at Pierre and"]
batch = tokenizer(prompts, return_tensors="pt", padding=True)
torch.manual_seed(0)  # the same seed on every rank: sampling draws the same tokens everywhere
out = opt.generate(**batch, max_new_tokens=40, do_sample=True, top_k=20, pad_token_id=tokenizer.pad_token_id)
if rank == 0:
    for row in out:
        print(tokenizer.decode(row, skip_special_tokens=True), "\n")
    world = dist.get_world_size() if distributed else 1
    print(f"H2O state on this rank: {opt.kv_cache_bytes() / 1024:.0f} KiB for {opt.layers[0].kv_heads} KV head(s) "
          f"per layer ({world} rank(s))")
if distributed:
    dist.destroy_process_group()
