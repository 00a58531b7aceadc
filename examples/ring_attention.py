"""A causal MultiHeadAttention layer run on a sequence sharded across processes (ring attention).

Launch with torchrun; every process holds 1/P of the sequence::

    torchrun --standalone --nproc-per-node=4 examples/ring_attention.py --seq-len 4096 --check

Across hosts, see docs/distributed.md ("Running across machines"). Uses NCCL when CUDA is
available (one GPU per process, picked by LOCAL_RANK), gloo on CPUs.

With ``--check`` (small sequences only) rank 0 also runs the layer on the whole sequence in one
process and compares the outputs and the summed parameter gradients with the sharded run.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

import multihead as mh
from multihead import masks
from multihead.distributed import context_parallel, shard_sequence, unshard_sequence


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=4096, help="L, a multiple of 2 x the number of processes")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--check", action="store_true", help="compare with one process on rank 0")
    args = p.parse_args()

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()

    # The same weights on every rank (as after loading a checkpoint).
    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(args.d_model, args.heads, num_kv_heads=args.kv_heads, causal=True, device=device)
    ring_layer = context_parallel(layer)  # zigzag layout: the default for a causal layer

    # In a real run each rank would load only its shard; here everyone builds the same batch.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.seq_len, args.d_model, generator=g).to(device)
    keep = torch.ones(1, args.seq_len, dtype=torch.bool, device=device)
    keep[:, -args.seq_len // 8:] = False  # the last eighth is padding

    x_shard = shard_sequence(x, rank, world, "zigzag")  # (1, L/P, d_model)
    keep_shard = shard_sequence(keep, rank, world, "zigzag", dim=-1)  # (1, L/P)
    out = ring_layer(x_shard, mask=masks.key_padding(keep_shard))
    out.square().mean().backward()
    for param in layer.parameters():  # each rank holds its shard's share of the gradient
        dist.all_reduce(param.grad)
    print(f"rank {rank}/{world}: x shard {tuple(x_shard.shape)} -> out {tuple(out.shape)}", flush=True)

    if args.check:
        shards = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(shards, out.detach().contiguous())
        if rank == 0:
            full = unshard_sequence(shards, "zigzag")
            sharded_grads = [p.grad.clone() for p in layer.parameters()]
            layer.zero_grad()
            ref = layer(x, mask=masks.key_padding(keep))
            # the loss above is a mean over each rank's shard: P shards -> divide by P
            (ref.square().mean() * world).backward()
            out_err = (full - ref).abs().max().item()
            grad_err = max((a - p.grad).abs().max().item() for a, p in zip(sharded_grads, layer.parameters()))
            print(f"max |ring - one process|: output {out_err:.2e}, parameter gradients {grad_err:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
