import sys

from s2s_rt.cli import main

sys.exit(main())
