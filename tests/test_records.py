"""Records: round trip, never overwritten, written atomically, malformed ones refused by file and field."""

from __future__ import annotations

import copy
import datetime as dt
import json
from pathlib import Path

import pytest

from anelab.errors import AnelabInputError
from anelab.records import (
    PROVENANCE_FIELDS,
    SCHEMA_VERSION,
    atomic_write_text,
    make_record,
    provenance,
    read_record,
    read_records,
    write_record,
)

# the seed's machine, written out by hand
M3 = {
    "machine_model": "Mac15,3",
    "chip": "Apple M3",
    "os_version": "macOS 27.0",
    "python": "3.11",
    "coremltools": "9.0",
    "numpy": "2.3.5",
    "anelab": "0.1.0",
    "git_revision": "unknown",
    "date": "unknown",
}
SOURCE = {"document": "ane-prefill-research.txt", "record": "v5.6-ane-38-4bit.json"}


def _record(**overrides) -> dict:
    record = make_record(
        "prefill_seconds",
        {"model": "qwen3.8-125b-a6b-4bit", "prompt_tokens": 4333},
        {"gpu_s": 197.5, "ane_s": 273.5},
        origin="recorded",
        provenance_override=M3,
        source=SOURCE,
        unknown=["per-layer breakdown"],
    )
    record.update(overrides)
    return record


def _write_raw(directory: Path, name: str, record: dict) -> Path:
    path = directory / name
    path.write_text(json.dumps(record))
    return path


def _no_temporaries(directory: Path) -> bool:
    return not [p for p in directory.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp")]


# ---- round trip --------------------------------------------------------------------------------------


def test_round_trip(tmp_path):
    record = _record()
    path = write_record(tmp_path, record, name="v5.6-ane-38-4bit.json")
    assert json.loads(path.read_text()) == record  # the file is plain JSON of the record
    assert read_record(path) == record
    assert read_records(tmp_path) == [{**record, "_file": "v5.6-ane-38-4bit.json"}]
    assert record["schema_version"] == 1 and record["provenance"] == M3


def test_read_records_filters_by_kind_and_sorts_by_file_name(tmp_path):
    write_record(tmp_path, _record(), name="b.json")
    write_record(tmp_path, _record(kind="load_seconds"), name="a.json")
    assert [r["_file"] for r in read_records(tmp_path)] == ["a.json", "b.json"]
    assert [r["_file"] for r in read_records(tmp_path, kind="load_seconds")] == ["a.json"]


def test_fresh_provenance_names_this_machine():
    prov = provenance()
    assert list(prov) == list(PROVENANCE_FIELDS)
    assert all(isinstance(v, str) and v for v in prov.values())
    assert dt.datetime.fromisoformat(prov["date"]).tzinfo is not None
    import numpy

    assert prov["numpy"] == numpy.__version__


# ---- never overwritten -------------------------------------------------------------------------------


def test_second_write_to_the_same_name_is_refused_and_the_file_is_unchanged(tmp_path):
    path = write_record(tmp_path, _record(), name="r.json")
    before = path.read_bytes()
    with pytest.raises(AnelabInputError, match="never overwritten"):
        write_record(tmp_path, _record(results={"gpu_s": 1.0, "ane_s": 2.0}), name="r.json")
    assert path.read_bytes() == before
    assert _no_temporaries(tmp_path)


def test_automatic_names_never_collide(tmp_path):
    paths = [write_record(tmp_path, _record()) for _ in range(3)]
    assert len(set(paths)) == 3 and all(p.name.startswith("prefill_seconds-") for p in paths)
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_atomic_write_leaves_no_temporary_file(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "one")
    atomic_write_text(tmp_path / "a.txt", "two")  # overwrite=True is for derived files, not records
    assert (tmp_path / "a.txt").read_text() == "two"
    with pytest.raises(AnelabInputError):
        atomic_write_text(tmp_path / "a.txt", "three", overwrite=False)
    assert (tmp_path / "a.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_invalid_record_is_not_written(tmp_path):
    bad = _record()
    del bad["results"]
    with pytest.raises(AnelabInputError, match="results"):
        write_record(tmp_path, bad, name="bad.json")
    assert list(tmp_path.iterdir()) == []


def test_record_name_must_end_in_json(tmp_path):
    with pytest.raises(AnelabInputError, match=r"\.json"):
        write_record(tmp_path, _record(), name="record.txt")


# ---- malformed records are refused naming the file and field -----------------------------------------


def _mutations():
    def drop(field):
        def f(r):
            del r[field]

        return f

    def setter(field, value):
        def f(r):
            r[field] = value

        return f

    def drop_provenance(field):
        def f(r):
            del r["provenance"][field]

        return f

    return {
        "missing results": (drop("results"), "missing field 'results'"),
        "missing kind": (drop("kind"), "missing field 'kind'"),
        "missing schema_version": (drop("schema_version"), "missing field 'schema_version'"),
        "results is a list": (setter("results", [1, 2]), "field 'results' must be dict"),
        "schema_version is a string": (setter("schema_version", "1"), "field 'schema_version' must be int"),
        "schema_version is a bool": (setter("schema_version", True), "field 'schema_version' must be int"),
        "future schema_version": (setter("schema_version", SCHEMA_VERSION + 1), "newer than this anelab reads"),
        "schema_version 0": (setter("schema_version", 0), "field 'schema_version' must be >= 1"),
        "unknown origin": (setter("origin", "guessed"), "field 'origin' must be one of"),
        "recorded without source": (setter("source", None), "field 'source' must name the document and record"),
        "source without record": (setter("source", {"document": "x"}), "field 'source'"),
        "provenance without chip": (drop_provenance("chip"), "missing field 'provenance.chip'"),
        "unknown is a string": (setter("unknown", "everything"), "field 'unknown' must be list"),
    }


@pytest.mark.parametrize("case", list(_mutations()))
def test_malformed_record_is_refused_naming_file_and_field(tmp_path, case):
    mutate, expected = _mutations()[case]
    record = copy.deepcopy(_record())
    mutate(record)
    path = _write_raw(tmp_path, "broken.json", record)
    with pytest.raises(AnelabInputError) as e:
        read_record(path)
    message = str(e.value)
    assert str(path) in message and expected in message and "\n" not in message
    with pytest.raises(AnelabInputError, match="broken.json"):
        read_records(tmp_path)  # one bad file stops the directory read, named


def test_the_unmutated_record_reads(tmp_path):
    # control for every malformed case above
    assert read_record(_write_raw(tmp_path, "fine.json", _record()))["kind"] == "prefill_seconds"


def test_a_measured_record_needs_no_source(tmp_path):
    record = _record(origin="measured", source=None)
    assert read_record(_write_raw(tmp_path, "m.json", record))["origin"] == "measured"


def test_not_json_and_missing_files_are_refused_by_name(tmp_path):
    path = tmp_path / "garbled.json"
    path.write_text("{not json")
    with pytest.raises(AnelabInputError, match=r"garbled\.json: not valid JSON"):
        read_record(path)
    with pytest.raises(AnelabInputError, match=r"absent\.json: no such record file"):
        read_record(tmp_path / "absent.json")
    with pytest.raises(AnelabInputError, match="not a record file"):
        read_record(tmp_path)  # a directory
    with pytest.raises(AnelabInputError, match="must be a JSON object"):
        read_record(_write_raw(tmp_path, "list.json", [1, 2]))  # type: ignore[arg-type]
