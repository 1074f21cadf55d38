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


def map_fits(loaded: LoadedMap, reference_model: dict, candidate_model: dict) -> str | None:
    """Why the map does not relate these two runs, as one line, or None when it does, from the model facts their
    manifests record (`RunManifest.model`, no tensor is read): the reference records a transformers model config
    (`model["config"]` with a `model_type`) in which every [facts] key resolves, as mapping it will require; each
    [candidate_model] fact the candidate states agrees with that config, as the comparison will require; and the
    map's [[parameters]] rules turn the reference's recorded parameter shapes into exactly the candidate's
    (names and logical shapes), as the weight conversion that gave both runs the same weights did. When either
    run records no parameter shapes, at least one [candidate_model] fact must be stated and agree instead."""
    from ttrace_core.canonicalize.correspondence import candidate_shapes, facts_from_config

    config = reference_model.get("config")
    if not isinstance(config, dict) or not config.get("model_type"):
        return "the reference records no transformers model config (model.config with a model_type)"
    own = candidate_model.get("config")
    if isinstance(own, dict) and own.get("model_type") == config["model_type"]:
        return f"the candidate records the same {config['model_type']} config: the same implementation"
    try:
        facts = facts_from_config(loaded, config, "the reference's model config")
    except MapError as error:
        return str(error)
    stated = {fact: key for fact, key in loaded.spec.candidate_model.items() if fact in candidate_model and key in config}
    for fact, key in stated.items():
        if candidate_model[fact] != config[key]:
            return f"the candidate's {fact} is {candidate_model[fact]!r}, the reference's {key} {config[key]!r}"
    reference_shapes, shapes = reference_model.get("parameters"), candidate_model.get("parameters")
    if not isinstance(reference_shapes, dict) or not isinstance(shapes, dict) or not shapes:
        return None if stated else "neither the candidate's parameters nor a [candidate_model] fact to check"
    try:
        given = candidate_shapes(loaded, {name: tuple(shape) for name, shape in reference_shapes.items()}, facts)
    except MapError as error:
        return str(error)
    recorded = {name: tuple(shape) for name, shape in shapes.items()}
    if given != recorded:
        differing = sorted(set(given) ^ set(recorded)) or sorted(n for n in given if given[n] != recorded[n])
        return (f"its [[parameters]] give {len(given)} of the candidate's {len(recorded)} parameters with their "
                f"shapes (first difference: {differing[0]})")
    return None


def fitting_maps(reference_model: dict, candidate_model: dict) -> list[str]:
    """The shipped maps that relate a reference to a candidate by their recorded model facts (map_fits), by name."""
    names = []
    for name in shipped_map_names():
        try:
            fits = map_fits(load_map(MAPS_DIR / f"{name}.toml"), reference_model, candidate_model) is None
        except MapError:  # a broken shipped map is for `--map NAME` to report, not for a suggestion
            fits = False
        if fits:
            names.append(name)
    return names
