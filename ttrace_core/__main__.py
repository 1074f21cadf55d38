import sys

from ttrace_core.cli.main import main

sys.exit(main())
