"""``python -m node --bootstrap ADDR ...``: run a training node (thin wrapper of ``fusionp2p node``)."""

import sys

from fusionp2p.cli import main

if __name__ == "__main__":
    sys.exit(main(["node", *sys.argv[1:]]))
