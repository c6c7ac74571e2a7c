"""``python -m s2s_rt.bench``: the same as ``s2s-rt bench``."""

import sys

from s2s_rt.bench.cli import main

sys.exit(main())
