"""Imported by the fork server when tests/distributed/preload_workers.py declares it: it remembers the process
that imported it."""

import os

IMPORTED_BY = os.getpid()
