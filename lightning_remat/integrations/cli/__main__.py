"""``python -m lightning_remat.integrations.cli``: the ``lightning-remat`` command without installing its script."""

import sys

from . import main

sys.exit(main())
