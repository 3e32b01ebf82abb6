import sys
from pathlib import Path
from natlab import NatKind, NatLab
from net.test_holepunch import two_peers, punch_both, PORT

async def test_sym(natlab: NatLab, tmp_path: Path) -> None:
    a, b, hosts = await two_peers(natlab, NatKind.SYMMETRIC, tmp_path)
    guesses = ([hosts[0].public_address, PORT], [hosts[1].public_address, PORT])
    first, second = await punch_both(a, b, guesses, timeout=3)
    print(first, second, file=sys.stderr)
    print(natlab.routers["nat1"].exec("conntrack", "-L", check=False).stdout, file=sys.stderr)
