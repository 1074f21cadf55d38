import sys

from ttrace_core.cli import main

sys.exit(main())
