"""``python -m bootstrap --listen /ip4/0.0.0.0/tcp/4001 --home DIR``: run a bootstrap node."""

import sys

from fusionp2p.cli import main

if __name__ == "__main__":
    sys.exit(main(["bootstrap", *sys.argv[1:]]))
