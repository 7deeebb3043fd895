"""``python -m graphcap.bench``: the same as ``graphcap bench``."""

from graphcap.bench.command import main

raise SystemExit(main())
