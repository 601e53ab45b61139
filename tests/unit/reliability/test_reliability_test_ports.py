"""The ports tests give to the processes they start: never one twice, never one the kernel picks itself."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from hack.ports import PortAllocator, ephemeral_range, free_port, port_pool

pytestmark = pytest.mark.reliability


def test_free_port_never_hands_out_the_same_port_twice() -> None:
    """An operator given --metrics-port and --health-port from two calls got one port twice (CI)."""
    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)


def test_free_ports_lie_outside_the_ephemeral_range_that_bind_0_and_connect_draw_from() -> None:
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert not [p for p in ports if low <= p <= high]


def test_a_port_in_use_is_never_handed_out() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"no free TCP port left in {taken}-{taken}"):
            PortAllocator(range(taken, taken + 1), seed=0).take()


def test_a_pool_of_one_port_hands_it_out_once() -> None:
    port = free_port()
    allocator = PortAllocator(range(port, port + 1), seed=0)
    assert allocator.take() == port
    with pytest.raises(RuntimeError, match="no free TCP port"):
        allocator.take()


@pytest.mark.parametrize(
    ("text", "pool"),
    [("32768\t60999\n", range(10000, 32768)), ("1024 65000\n", range(65001, 65536)), ("junk", range(10000, 32768))],
)
def test_the_pool_sits_below_the_ephemeral_range_or_above_it(tmp_path: Path, text: str, pool: range) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    assert port_pool(ephemeral_range(path)) == pool
