"""Reading Mooncake-format traces."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvmesh.replay.trace import TraceError, TraceRequest, load_trace, parse_trace


def line(timestamp, input_length, hash_ids, output_length=8) -> str:
    return json.dumps({"timestamp": timestamp, "input_length": input_length, "output_length": output_length, "hash_ids": hash_ids})


def test_parse_gives_requests_in_seconds_and_arrival_order():
    lines = [line(0, 1024, [0, 1]), "", line(2500, 600, [0, 2]), line(1500, 512, [3], output_length=0)]
    assert parse_trace(lines) == [
        TraceRequest(index=0, arrival=0.0, input_length=1024, output_length=8, hash_ids=(0, 1)),
        TraceRequest(index=2, arrival=1.5, input_length=512, output_length=0, hash_ids=(3,)),
        TraceRequest(index=1, arrival=2.5, input_length=600, output_length=8, hash_ids=(0, 2)),
    ]


def test_time_scale_multiplies_timestamps_and_ties_keep_file_order():
    lines = [line(1000, 10, [5]), line(1000, 10, [6]), line(4000, 10, [7])]
    requests = parse_trace(lines, time_scale=0.5)
    assert [(r.index, r.arrival) for r in requests] == [(0, 0.5), (1, 0.5), (2, 2.0)]
    with pytest.raises(TraceError, match="time scale must be a positive number"):
        parse_trace(lines, time_scale=0)


def test_block_size_sets_how_many_hash_ids_a_prompt_needs():
    assert parse_trace([line(0, 250, [1, 2, 3])], block_size=100)[0].hash_ids == (1, 2, 3)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "trace, line 2: not valid JSON"),
        ("[1, 2]", "trace, line 2: expected a JSON object"),
        ('{"timestamp": 0, "input_length": 10}', "trace, line 2: missing output_length, hash_ids"),
        (line(-1, 10, [1]), "trace, line 2: timestamp must be a number of milliseconds >= 0, got -1"),
        (line("0", 10, [1]), "timestamp must be a number"),
        (line(0, 0, []), "input_length must be a positive integer, got 0"),
        (line(0, True, [1]), "input_length must be a positive integer, got True"),
        (line(0, 10, [1], output_length=-2), "output_length must be an integer >= 0, got -2"),
        (line(0, 10, "abc"), "hash_ids must be a list of integers"),
        (line(0, 10, [1.5]), "hash_ids must be a list of integers"),
        (line(0, 1025, [1, 2]), "trace, line 2: 2 hash_ids for input_length 1025; 512-token blocks need 3"),
    ],
)
def test_malformed_lines_name_the_line(text, message):
    with pytest.raises(TraceError) as error:
        parse_trace([line(0, 10, [0]), text])
    assert message in str(error.value)


def test_an_empty_trace_is_an_error():
    with pytest.raises(TraceError, match="no requests"):
        parse_trace(["", "  "])


def test_load_trace_reads_a_file_and_reports_a_missing_one(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(line(0, 512, [9]) + "\n" + line(10, 700, [9, 10]) + "\n")
    assert [r.hash_ids for r in load_trace(path)] == [(9,), (9, 10)]
    with pytest.raises(TraceError, match=f"cannot read trace {tmp_path / 'nope.jsonl'}"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "bad.jsonl").write_text(line(0, 512, [9]) + "\n{oops\n")
    with pytest.raises(TraceError, match=f"{tmp_path / 'bad.jsonl'}, line 2: not valid JSON"):
        load_trace(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("content, message", [("{oops\n", "line 1: not valid JSON"), (None, "cannot read trace")])
def test_cli_on_a_bad_trace_gives_a_clear_error(tmp_path, content, message):
    path = tmp_path / "trace.jsonl"
    if content is not None:
        path.write_text(content)
    done = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "replay", "--trace", str(path), "--simulate", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0
    assert "kvmesh replay: error:" in done.stderr and message in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
