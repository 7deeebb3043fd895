"""``python -m graphcap.bench``: the same as ``graphcap bench``."""

import sys

from graphcap.bench.command import main

sys.exit(main())
