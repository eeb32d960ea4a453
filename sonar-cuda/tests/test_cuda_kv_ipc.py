"""KV caches shared between two processes on one GPU through CUDA IPC (the SonarConnector's
same-GPU transport): what one process exports, another maps and reads, block for block."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import torch

from sonar.kv_transfer.kv_wire import CudaIpcHandle

pytestmark = pytest.mark.cuda

SHAPE = (2, 8, 16, 2, 64)  # [K/V, blocks, block size, heads, head dim]

EXPORTER = f"""
import sys, msgspec, torch
from sonar.kv_transfer.cuda_ipc import export_kv_caches
caches = [torch.arange(torch.Size({SHAPE}).numel(), device="cuda", dtype=torch.float32).view({SHAPE}) + 1000 * layer for layer in range(2)]
sys.stdout.write(msgspec.msgpack.encode(export_kv_caches(caches)).hex() + "\\n")
sys.stdout.flush()
sys.stdin.readline()  # the caches live until the reader is done
"""


@pytest.fixture
def exported():
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    child = subprocess.Popen([sys.executable, "-c", EXPORTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line, "the exporting process ended early"
        yield msgspec.msgpack.decode(bytes.fromhex(line.strip()), type=list[CudaIpcHandle])
    finally:
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(30)


def test_another_process_reads_the_exported_blocks(exported) -> None:
    from sonar.kv_transfer.cuda_ipc import import_kv_caches

    mine = [torch.zeros((2, 4, *SHAPE[2:]), device="cuda") for _ in range(2)]
    theirs = import_kv_caches(exported, mine, torch.cuda.current_device())
    assert theirs[0].shape == SHAPE  # their number of blocks, not ours
    expected = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE)
    for layer, (kv, remote) in enumerate(zip(mine, theirs)):
        kv.index_copy_(1, torch.tensor([0, 3], device="cuda"), remote.index_select(1, torch.tensor([5, 2], device="cuda")))
        assert torch.equal(kv[:, 0].cpu(), expected[:, 5] + 1000 * layer)
        assert torch.equal(kv[:, 3].cpu(), expected[:, 2] + 1000 * layer)


def test_a_handle_smaller_than_its_tensor_is_refused(exported) -> None:
    from sonar.kv_transfer.cuda_ipc import import_kv_caches

    lying = [msgspec.structs.replace(h, num_blocks=h.num_blocks * 4) for h in exported]
    with pytest.raises(ValueError, match="IPC handle"):
        import_kv_caches(lying, [torch.zeros((2, 4, *SHAPE[2:]), device="cuda") for _ in range(2)], torch.cuda.current_device())
