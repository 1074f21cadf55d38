"""The correspondence maps ttrace ships (maps/*.toml), found by name: one file per architecture pair.

A map relates two implementations of one architecture tensor by tensor (canonicalize/correspondence.py
reads it; docs/porting.md describes the format). `--map NAME` names a shipped one (the file's stem,
"hf-llama--megatron-gpt"); a path to a .toml file names any other.
"""

from __future__ import annotations

from pathlib import Path

from ttrace_core.canonicalize.correspondence import LoadedMap, load_map
from ttrace_core.errors import MapError

MAPS_DIR = Path(__file__).resolve().parent / "maps"


def shipped_map_names() -> list[str]:
    return sorted(path.stem for path in MAPS_DIR.glob("*.toml"))


def find_map(name_or_path: str | Path) -> LoadedMap:
    """A shipped map by name, or the map file at a path; MapError naming the shipped ones otherwise."""
    text = str(name_or_path)
    if text in shipped_map_names():
        return load_map(MAPS_DIR / f"{text}.toml")
    path = Path(text)
    if path.suffix == ".toml" or path.exists():
        return load_map(path)
    raise MapError(f"--map {text}: no shipped map of that name and no such .toml file; the shipped maps are "
                   f"{', '.join(shipped_map_names()) or 'none'} (docs/porting.md)")
