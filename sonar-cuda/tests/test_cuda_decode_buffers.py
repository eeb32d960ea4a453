"""The decode graphs' input buffers: a step's host inputs reach the device views in one copy."""

from __future__ import annotations

import torch

from sonar_cuda.decode_graphs import DecodeBuffers


def test_one_upload_carries_tokens_lengths_and_the_steps_block_table_rows(device: torch.device) -> None:
    buffers = DecodeBuffers.allocate(8, 5, device)
    assert buffers.tokens.dtype == torch.int64 and buffers.tokens.shape == (3, 8)
    assert buffers.seq_lens.tolist() == [1] * 8 and buffers.block_tables.shape == (8, 5)
    buffers.block_tables.fill_(-7)  # rows past the step's keep what they held
    host = buffers.next_host()
    host.tokens.copy_(torch.arange(24).view(3, 8) + 2**40)  # needs all 64 bits
    host.seq_lens.copy_(torch.arange(8, dtype=torch.int32) + 3)
    host.block_tables.copy_(torch.arange(40, dtype=torch.int32).view(8, 5))
    buffers.upload(host, 3)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(buffers.tokens.cpu(), host.tokens)
    assert torch.equal(buffers.seq_lens.cpu(), host.seq_lens)
    assert torch.equal(buffers.block_tables[:3].cpu(), host.block_tables[:3])
    assert (buffers.block_tables[3:] == -7).all()
    assert buffers.next_host() is not host and buffers.next_host() is host  # the two sets alternate
