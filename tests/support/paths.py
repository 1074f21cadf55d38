"""Where the repository's own folders are, for tests at any depth under tests/."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SAMPLES_DIR = REPO / "sample_traces"
