"""``python -m fusionp2p.cli …`` is the ``fusionp2p`` command."""

import sys

from fusionp2p.cli.main import main

sys.exit(main())
