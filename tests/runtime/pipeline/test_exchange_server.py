"""The exchange server's failure path and the wire header, in one process (no process group)."""

import pytest
import torch

from megatron_slim.runtime.pipeline.exchange_server import BlockServer, ServedBlock
from megatron_slim.runtime.pipeline.exchange_wire import TAG_SPAN, Header, done_header, empty_header, layer_tag


def test_a_failing_block_thread_raises_on_the_main_thread_at_join():
    server = BlockServer([ServedBlock(3, 1, False)], group=None, device=torch.device("cpu"), backend_for=None)
    server.start()  # its receive fails at once: no process group is initialized
    with pytest.raises(RuntimeError, match=r"serving block 3 \(sender rank 1\) failed"):
        server.join()


def test_the_header_round_trips_and_done_ends_a_block():
    q, k = torch.zeros(2, 5, 4, 8, dtype=torch.bfloat16), torch.zeros(2, 7, 2, 8, dtype=torch.bfloat16)
    head = Header.of(q, k, 0.3535)
    buffer = empty_header(torch.device("cpu"))
    buffer.copy_(head.encode(torch.device("cpu")))
    got = Header.decode(buffer)
    assert got == head and (got.q_shape, got.kv_shape, got.lse_shape) == ((2, 5, 4, 8), (2, 7, 2, 8), (2, 4, 5))
    assert not got.done and Header.decode(done_header(torch.device("cpu"))).done


def test_tags_stay_in_their_range_and_apart_per_block_and_layer():
    tags = {layer_tag(block, layer) for block in range(50) for layer in range(80)}
    assert len(tags) == 50 * 80 and min(tags) >= 2**30 and max(tags) + 15 < 2**31 - 1 and TAG_SPAN < 2**30
