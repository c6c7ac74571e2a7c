"""Run the evaluation: ``python -m s2s_rt.evaluation --help``."""

import sys

from s2s_rt.evaluation.cli import main

sys.exit(main())
