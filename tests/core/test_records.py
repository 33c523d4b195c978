"""Records: round trip, never overwritten, written atomically, malformed ones refused by file and field."""

from __future__ import annotations

import copy
import datetime as dt
import json
from pathlib import Path

import pytest

from anelab.core.errors import AnelabInputError
from anelab.core.records import (
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


# ---- listing and comparing records from several machines (anelab records list / compare) ------------

from anelab import cli  # noqa: E402
from anelab.core.paths import DATA_DIR  # noqa: E402
from anelab.publish import records_compare as rc  # noqa: E402

MAC_B = {**M3, "machine_model": "Mac16,1", "chip": "Apple M4", "os_version": "macOS 27.1", "date": "2026-11-01"}


def _fold_record(provenance_: dict, fold_error: float) -> dict:
    check = {"chunk": 64, "history": 64, "fold_error": fold_error, "causal_off": 0.079, "noise_ratio": 16.0}
    return make_record(
        "mask_fold",
        {"checkpoint": "tiny", "compress_ratio": 4, "seed": 0},
        {"widths": {"32": {"check": {**check, "chunk": 32, "history": 32, "fold_error": 1.0}}, "64": {"check": check}}},
        provenance_override=provenance_,
    )


def _two_machines(tmp_path: Path) -> tuple[Path, Path]:
    """The same file name written on two machines, as two copied-back run trees."""
    a, b = tmp_path / "mac_a" / "records", tmp_path / "mac_b" / "records"
    write_record(a, _fold_record(M3, 0.0047), name="mask_fold-20261130T120000Z-1.json")
    write_record(b, _fold_record(MAC_B, 0.0094), name="mask_fold-20261130T120000Z-1.json")
    return a, b


def test_records_from_two_machines_merge_without_collisions(tmp_path):
    a, b = _two_machines(tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "again.json").write_text((a / "mask_fold-20261130T120000Z-1.json").read_text())
    records = rc.gather_records([a, b, copy])
    assert len(records) == 2  # same file name on both machines: both kept; the identical copy: once
    assert {r["provenance"]["chip"] for r in records} == {"Apple M3", "Apple M4"}
    assert [r["provenance"]["chip"] for r in rc.select(records, machine="m4")] == ["Apple M4"]
    assert rc.select(records, kind="load_timing") == []
    with pytest.raises(AnelabInputError, match="no such records directory"):
        rc.gather_records([tmp_path / "absent"])


def test_compare_puts_fresh_and_predicted_beside_the_recorded_values(tmp_path):
    a, b = _two_machines(tmp_path)
    rows = rc.compare(rc.gather_records([DATA_DIR, a, b]))
    fold = [r for r in rows if r["quantity"] == "fold error: graph vs reference"]
    assert sorted(r["fresh"] for r in fold) == pytest.approx([0.47, 0.94])  # percent of the widest chunk
    m4 = next(r for r in fold if "M4" in r["fresh_provenance"])
    assert m4["recorded"] == 0.47  # the seed's value (data/seed-qsa-fold-correctness.json)
    assert m4["ratio"] == pytest.approx(2.0) and m4["difference"] == pytest.approx(0.47)
    assert "recorded on Mac15,3 (M3)" in m4["recorded_provenance"] and "Mac16,1 (M4)" in m4["fresh_provenance"]
    assert "chunk 64" in m4["workload"]
    # gather sizing at the seed's geometry, by hand: 24 x 4096 x 2051 x 256 x 2 bytes and 24 x 4096 x 8192 x 2
    sizing = {r["quantity"]: r for r in rows if r["fresh_provenance"].startswith("predicted: anelab.core.gather_size")}
    assert sizing["gathered keys at chunk 4,096, budget 2,051"]["fresh"] == pytest.approx(103.230210048)
    assert sizing["dense score matrix at chunk 4,096"]["fresh"] == pytest.approx(1.610612736)
    assert sizing["gathered keys at chunk 4,096, budget 2,051"]["recorded"] == 103
    loads = [r for r in rows if r["quantity"] == "setup: cold load of variant h0"]
    assert [r["fresh"] for r in loads][0] is None and "no fresh load_timing record" in loads[0]["fresh_provenance"]
    assert loads[1]["recorded"] == 6.7 and loads[1]["fresh_provenance"].startswith("predicted: planner")
    only_m4 = rc.compare(rc.gather_records([DATA_DIR, a, b]), machine="M4")
    assert len([r for r in only_m4 if r["quantity"] == "fold error: graph vs reference"]) == 1
    with pytest.raises(AnelabInputError, match="include data/"):
        rc.compare(rc.gather_records([a, b]))  # without the seeds there is nothing to compare with


def test_records_cli_list_and_compare(tmp_path, capsys):
    a, b = _two_machines(tmp_path)
    assert cli.main(["records", "list", "--dir", str(a), "--dir", str(b), "--machine", "M4"]) == 0
    out = capsys.readouterr().out
    assert "Mac16,1 (M4)" in out and "Mac15,3" not in out and "1 records" in out
    assert cli.main(["records", "compare", "--dir", str(DATA_DIR), "--dir", str(b)]) == 0
    out = capsys.readouterr().out
    assert "fold error: graph vs reference" in out and "measured on Mac16,1 (M4)" in out and "gathered keys" in out
    assert cli.main(["records", "compare", "--kind", "mask_fold"]) == 2
    assert "applies to list" in capsys.readouterr().err
