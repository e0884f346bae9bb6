"""Trace loading: the Mooncake JSONL format, chained block hashes, and every kind of bad input."""

from __future__ import annotations

import math
import pickle

import pytest

from natsched.sim.errors import EmptyTraceError, SimConfigError, SimError, TraceError, TraceFormatError
from tests.factories.sim import make_trace, trace_line, trace_row, write_trace
from natsched.sim.trace import MOONCAKE_TRACE, ROOT_HASH, BlockChainer, load_mooncake



def test_fields_are_converted_and_arrivals_start_at_zero():
    t = make_trace([trace_row(5000, n_in=1100, n_out=7, ids=[1, 2, 3]), trace_row(5250, ids=[1])])
    a, b = t.requests
    assert (a.arrival, b.arrival) == (0.0, 0.25)
    assert (a.input_length, a.output_length) == (1100, 7)
    assert len(a.hashes) == 2  # 1100 tokens = 2 full blocks of 512: the partial third is never shared
    assert (a.id, b.id, a.line, b.line) == ("r0", "r1", 1, 2)
    assert t.block_size == 512 and t.duration == 0.25


def test_unsorted_lines_are_replayed_in_time_order_stably():
    t = make_trace([trace_row(300, ids=[3]), trace_row(100, ids=[1]), trace_row(100, ids=[2])])
    assert [r.line for r in t.requests] == [2, 3, 1]
    assert [r.index for r in t.requests] == [0, 1, 2]


def test_speedup_compresses_time_and_scaled_is_relative_to_the_file():
    rows = [trace_row(0), trace_row(1000), trace_row(4000)]
    t = make_trace(rows, speedup=2.0)
    assert [r.arrival for r in t.requests] == [0.0, 0.5, 2.0]
    again = t.scaled(4.0)
    assert [r.arrival for r in again.requests] == [0.0, 0.25, 1.0]
    assert again.speedup == 4.0 and t.speedup == 2.0  # the original is untouched
    assert [r.hashes for r in again.requests] == [r.hashes for r in t.requests]


def test_limit_keeps_the_first_n_requests():
    t = make_trace([trace_row(i * 10, ids=[i]) for i in range(10)], limit=3)
    assert len(t) == 3 and [r.line for r in t.requests] == [1, 2, 3]
    assert len(t.head(2)) == 2


def test_blank_lines_are_skipped_but_line_numbers_stay_true():
    t = make_trace(["", trace_line(0), "   ", trace_line(10)])
    assert [r.line for r in t.requests] == [2, 4]


def test_equal_id_prefixes_give_equal_chains_and_position_matters():
    t = make_trace([trace_row(0, ids=[7, 8, 9]), trace_row(1, ids=[7, 8, 5]), trace_row(2, ids=[6, 8, 9]),
                    trace_row(3, ids=[7, 8, 9])])
    a, b, c, d = (r.hashes for r in t.requests)
    assert a == d
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a, c))  # same id 8 after a different block is a different prefix
    assert all(0 <= h < 2**63 for h in a + b + c)


def test_chains_are_stable_across_chainers_and_memoisation():
    assert BlockChainer().chain([1, 2, 3]) == BlockChainer().chain([1, 2, 3])
    ch = BlockChainer()
    first = ch.chain([1, 2, 3])
    assert ch.chain([1, 2, 3, 4])[:3] == first
    assert first[0] != ROOT_HASH


@pytest.mark.parametrize(
    "line, what",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1}', "'hash_ids'"),
        ('{"input_length": 5, "output_length": 1, "hash_ids": []}', "'timestamp'"),
        ('{"timestamp": "1", "input_length": 5, "output_length": 1, "hash_ids": []}', "'timestamp'"),
        ('{"timestamp": 1, "input_length": "5", "output_length": 1, "hash_ids": []}', "'input_length'"),
        ('{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}', "'input_length' must be >= 1"),
        ('{"timestamp": 1, "input_length": 5, "output_length": -1, "hash_ids": []}', "'output_length'"),
        ('{"timestamp": 1, "input_length": 5, "output_length": true, "hash_ids": []}', "'output_length'"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": 3}', "'hash_ids' must be a list"),
        ('{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2.5]}', "'hash_ids'"),
    ],
)
def test_a_bad_line_is_named_by_number(line, what):
    with pytest.raises(TraceFormatError) as err:
        make_trace([trace_line(0), trace_line(1), line], source="t.jsonl")
    assert err.value.line == 3
    assert "t.jsonl:3:" in str(err.value) and what in str(err.value)
    assert isinstance(err.value, TraceError) and isinstance(err.value, SimError)


def test_missing_fields_are_all_named():
    with pytest.raises(TraceFormatError, match="missing fields 'input_length', 'output_length'"):
        make_trace(['{"timestamp": 0, "hash_ids": []}'])


def test_format_error_survives_pickling_for_worker_processes():
    err = TraceFormatError("f.jsonl", 7, "bad")
    back = pickle.loads(pickle.dumps(err))
    assert (back.line, str(back)) == (7, str(err))


@pytest.mark.parametrize("rows", [[], ["", "  "]])
def test_an_empty_trace_is_refused(rows):
    with pytest.raises(EmptyTraceError, match="no request"):
        make_trace(rows)


@pytest.mark.parametrize("speedup", [0, -1.0, math.nan, math.inf])
def test_speedup_must_be_positive_and_finite(speedup):
    with pytest.raises(SimConfigError, match="speedup"):
        make_trace([trace_row()], speedup=speedup)
    with pytest.raises(SimConfigError, match="speedup"):
        make_trace([trace_row()]).scaled(speedup)


def test_limit_must_be_positive():
    with pytest.raises(SimConfigError, match="limit"):
        make_trace([trace_row()], limit=0)


def test_files_load_and_a_missing_file_is_a_trace_error(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [trace_row(0, ids=[1, 2]), trace_row(20, ids=[1, 2])])
    t = load_mooncake(path, speedup=2)
    assert len(t) == 2 and t.requests[1].arrival == 0.01 and t.source == str(path)
    with pytest.raises(TraceError, match="cannot read trace"):
        load_mooncake(tmp_path / "absent.jsonl")


def test_the_shipped_mooncake_trace_loads_whole_and_limited():
    assert MOONCAKE_TRACE.exists(), f"the shipped trace is missing at {MOONCAKE_TRACE}"
    t = load_mooncake(MOONCAKE_TRACE)
    assert len(t) == 3993
    assert all(len(r.hashes) == r.input_length // 512 for r in t.requests)
    assert len(load_mooncake(MOONCAKE_TRACE, limit=200)) == 200
