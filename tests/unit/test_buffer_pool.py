"""The receive-buffer pool hands a buffer out again only when nothing decoded from it is alive."""

from __future__ import annotations

import ctypes

import torch

from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.tensor_stream import BufferPool
from fusionp2p.wire import tensor_frame as tf


def _addr(mv: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


def _message_buffer(pool: BufferPool, value: float) -> tuple[memoryview, int]:
    data = tf.message_bytes(TensorMessage(job="j", kind="act", tensors=(torch.full((1 << 18,), value),)))
    mv = pool.get(len(data))
    mv[:] = data
    return mv, _addr(mv)


def test_buffer_is_reused_only_after_every_tensor_is_dropped() -> None:
    pool = BufferPool(max_buffers=4, min_size=1024)
    mv, first = _message_buffer(pool, 1.0)
    view = tf.decode_message(mv)["tensors"][0][5:]  # a view of a decoded tensor keeps the buffer
    del mv
    mv2, second = _message_buffer(pool, 2.0)
    assert second != first
    assert torch.all(view == 1.0)  # untouched by the second message
    del mv2
    del view
    _mv3, third = _message_buffer(pool, 3.0)
    assert third in (first, second)
    assert pool.reused == 1 and pool.allocated == 2


def test_small_buffers_are_not_pooled_and_the_pool_is_bounded() -> None:
    pool = BufferPool(max_buffers=2, max_bytes=1 << 30, min_size=1 << 20)
    pool.get(1000)
    assert pool.allocated == 0  # below min_size: plain allocation
    held = [pool.get(2 << 20) for _ in range(3)]
    assert pool.allocated == 3 and len(pool._arrays) == 2
    del held
    assert sum(a.nbytes for a in pool._arrays) <= 4 << 20
