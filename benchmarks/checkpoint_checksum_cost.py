#!/usr/bin/env python3
"""What the checkpoint checksums cost: DCP save and load of a ~1B-parameter fp32 state dict on one
GPU, with and without ``.checksums.json`` (docs/checkpointing.md, "What a checkpoint guarantees")::

    PYTHONPATH=. python benchmarks/checkpoint_checksum_cost.py --dir /tmp --out results.json

One process (``no_dist=True``), one shard file (DCP's default of one writer thread), to the local
disk under ``--dir``. Per repetition:
  save  FileSystemWriter               vs  ChecksummedFileSystemWriter (hashes the file it wrote)
  load  FileSystemReader               vs  SafeFileSystemReader (verifies size and sha256 first)
                                       and SafeFileSystemReader without a manifest (sizes only)
Loads run warm (files still in the page cache after the save) and cold (evicted with
``posix_fadvise(DONTNEED)``; DCP fsyncs the files, so their pages are clean and can be dropped).
Reported: the fastest of ``--reps`` repetitions of each, in seconds, and sha256 throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from megatron_fsdp_v2.checkpoint.integrity import MANIFEST, ChecksummedFileSystemWriter, file_checksum
from megatron_fsdp_v2.checkpoint.safe_reader import SafeFileSystemReader


def _state_dict(params: int, device: str) -> dict:
    """``params`` fp32 parameters in 8192-wide matrices (the last one narrower)."""
    sd, left, i = {}, params, 0
    while left > 0:
        rows = min(8192, -(-left // 8192))
        sd[f"layer{i}.weight"] = torch.randn(rows, 8192, device=device)
        left -= rows * 8192
        i += 1
    return sd


def _evict(directory: str) -> None:
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1 << 30, help="fp32 parameters (default 2**30)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (local disk)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sd = _state_dict(args.params, device)
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    root = tempfile.mkdtemp(prefix="ckpt_checksum_cost_", dir=args.dir)
    plain, summed = os.path.join(root, "plain"), os.path.join(root, "checksummed")
    times: dict = {}

    def record(label, seconds):
        times.setdefault(label, []).append(round(seconds, 3))
        print(f"{label}: {seconds:.3f} s", flush=True)

    try:
        for _ in range(args.reps):
            for path in (plain, summed):
                shutil.rmtree(path, ignore_errors=True)
            record("save FileSystemWriter", _timed(lambda: dcp.save(sd, storage_writer=FileSystemWriter(plain),
                                                                    no_dist=True)))
            record("save ChecksummedFileSystemWriter", _timed(lambda: dcp.save(
                sd, storage_writer=ChecksummedFileSystemWriter(summed), no_dist=True)))
            for cache in ("warm", "cold"):
                for label, reader in (("FileSystemReader", lambda: FileSystemReader(plain)),
                                      ("SafeFileSystemReader, verifying sha256", lambda: SafeFileSystemReader(summed)),
                                      ("SafeFileSystemReader, sizes only", lambda: SafeFileSystemReader(plain))):
                    if cache == "cold":
                        _evict(plain)
                        _evict(summed)
                    record(f"load {cache} {label}", _timed(lambda: dcp.load(target, storage_reader=reader(),
                                                                              no_dist=True)))
            assert all(torch.equal(target[k], v) for k, v in sd.items())
        shard = next(n for n in os.listdir(summed) if n.endswith(".distcp"))
        nbytes = os.path.getsize(os.path.join(summed, shard))
        hashing = _timed(lambda: file_checksum(os.path.join(summed, shard)))
        with open(os.path.join(summed, MANIFEST)) as f:
            listed = sorted(json.load(f)["files"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {
        "params": args.params, "shard_bytes": nbytes, "files_in_manifest": listed, "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(), "dir": args.dir,
        "sha256_GBps_warm": round(nbytes / hashing / 1e9, 2),
        "seconds_best": {label: min(values) for label, values in times.items()}, "seconds_all": times,
    }
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
