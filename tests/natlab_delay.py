"""The user-space delay/loss stage of a natlab router (this kernel has no sch_netem).

Run inside a router's namespace, attached to a persistent TUN device into which the router's
policy routing sends every forwarded packet: each packet read from the device is dropped with
probability LOSS or written back into it DELAY_MS later, and the kernel then routes it onward
(now arriving from the TUN device, so the main table applies). A packet crossing the router
passes the stage once, so a round trip through one router takes 2 x DELAY_MS more.

    ip netns exec NS python natlab_delay.py --dev dly --delay-ms 20 --loss 0.01

Prints "ready" once attached. Exits on SIGTERM/SIGINT, and by itself when its parent dies (so
that a crashed test run does not leave it behind). Standard library only.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MAX_BATCH = 256  # packets read per wake-up before due packets are written again


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def run(fd: int, delay: float, loss: float, rng: random.Random) -> None:
    parent = os.getppid()
    queue: collections.deque[tuple[float, bytes]] = collections.deque()  # FIFO: delay is constant
    next_parent_check = time.monotonic() + 1.0
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            try:
                os.write(fd, queue.popleft()[1])
            except OSError:
                pass  # a packet the stack refuses is lost, like on a wire
        if now >= next_parent_check:
            if os.getppid() != parent:
                return
            next_parent_check = now + 1.0
        timeout = min(next_parent_check, queue[0][0] if queue else next_parent_check) - now
        readable, _, _ = select.select([fd], [], [], max(timeout, 0.0))
        if not readable:
            continue
        arrived = time.monotonic()
        for _ in range(MAX_BATCH):
            try:
                packet = os.read(fd, 65536)
            except BlockingIOError:
                break
            if loss and rng.random() < loss:
                continue
            queue.append((arrived + delay, packet))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dev", required=True)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--loss", type=float, default=0.0, help="drop probability per packet")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    if not 0.0 <= args.loss < 1.0 or args.delay_ms < 0:
        parser.error("need 0 <= loss < 1 and delay >= 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    fd = open_tun(args.dev)
    print("ready", flush=True)
    try:
        run(fd, args.delay_ms / 1000.0, args.loss, random.Random(args.seed))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
