"""format/records.py: a trace's text becomes a typed record, or one line naming the file and the field.

A key the record does not have is refused at any depth. msgspec leaves out a key a dataclass record does not
have, so a key renamed by one flipped bit ("mesh_axis_na}es") once read as the field at its default, and a
damaged layout passed compare (the robustness benchmark found it; tests/test_damaged_traces.py has the case).
"""

from __future__ import annotations

import json

import msgspec
import pytest

from ttrace_core.errors import TraceFormatError
from ttrace_core.format.records import meta_from_json, record_from_data
from ttrace_core.format.schema import Layout, RunManifest, TensorKey, TensorMeta, TensorStats
from ttrace_core.format.tensor_index import rows_from_text, row_line

META = TensorMeta(key=TensorKey(step=0, micro_batch=0, phase="forward", fqn="layers.0", slot="output.0"), rank=1,
                  dtype="float32", local_shape=(2, 3),
                  layout=Layout(global_shape=(4, 3), mesh_shape=(2,), coordinate=(1,), placements=("S(0)",),
                                mesh_axis_names=("tp",)), seq=0)
MANIFEST = RunManifest(role="reference", world_size=2, degrees={"tp": 2}, mesh_shape=[2], mesh_axis_names=["tp"],
                       rank_coordinates=[[0], [1]])


def _renamed(text: bytes, key: str, new: str) -> bytes:
    assert text.count(f'"{key}"'.encode()) == 1
    return text.replace(f'"{key}"'.encode(), f'"{new}"'.encode())


def test_a_record_round_trips_through_its_one_serialized_form():
    assert meta_from_json(msgspec.json.encode(META), "f.h5") == META
    assert rows_from_text(row_line("d", META) + b"\n" + row_line(None, META), "f.h5")[1].meta == META
    assert record_from_data(json.loads(json.dumps(MANIFEST.to_dict())), RunManifest, "m.json", "manifest", "redo") == MANIFEST


@pytest.mark.parametrize("key, at", [("mesh_axis_names", "$.layout"), ("num_inf", None), ("slot", "$.key"),
                                     ("local_shape", "$")])
def test_a_renamed_key_of_a_tensors_metadata_is_refused_with_its_path(key, at):
    meta = msgspec.structs.replace(META, stats=TensorStats(numel=6, sum=0.0, sumsq=0.0, min=0.0, max=0.0, num_nan=0,
                                                           num_inf=0))
    text = _renamed(msgspec.json.encode(meta), key, key[:-1] + "}")
    with pytest.raises(TraceFormatError) as raised:
        meta_from_json(text, "rank_00001.step_000000.h5")
    where = "" if at == "$" else f"field {at or '$.stats'}: "
    assert str(raised.value) == (f"rank_00001.step_000000.h5: tensor metadata is malformed ({where}Object contains "
                                 f"unknown field `{key[:-1]}}}`); re-record this rank")
    with pytest.raises(TraceFormatError, match=f"line 1: .*unknown field `{key[:-1]}}}`"):
        rows_from_text(_renamed(row_line("d", meta), key, key[:-1] + "}"), "f.h5")


@pytest.mark.parametrize("path", [["blind_spots"], ["correspondence"], ["degrees"]])
def test_a_renamed_manifest_key_is_refused_not_read_as_its_default(path):
    data = json.loads(json.dumps(MANIFEST.to_dict()))
    data[path[0] + "z"] = data.pop(path[0])
    with pytest.raises(TraceFormatError) as raised:
        record_from_data(data, RunManifest, "run/manifest.json", "manifest", "re-record the run")
    if path[0] == "degrees":  # required by the mesh: missing degrees is its own error, met first
        assert "run/manifest.json: not a valid manifest" in str(raised.value)
    else:
        assert str(raised.value) == ("run/manifest.json: not a valid manifest (Object contains unknown field "
                                     f"`{path[0]}z`); re-record the run")


def test_a_key_the_records_own_serialized_form_writes_is_accepted_at_any_depth():
    """A record's `to_dict` may write more than its fields (a comparison writes its verdict first): those keys
    are its own, not damage; a key inside a nested record or a list of records is checked too."""
    from ttrace_core.compare.results import RunComparison
    comparison = RunComparison(reference="r", candidate="c", steps_compared=[0], notes=[], comparisons=[])
    data = json.loads(comparison.to_json())
    assert "passed" in data and RunComparison.from_json(json.dumps(data)).reference == "r"
    data["notes_"] = []
    with pytest.raises(TraceFormatError, match=r"comparison \(Object contains unknown field `notes_`\)"):
        RunComparison.from_json(json.dumps(data))
