"""bench codec compares like with like: the same bytes decode to the same fields both ways, and
both contenders refuse every malformed input the benchmark names."""

from __future__ import annotations

import msgspec

from natsched.bench.codec import refusals, run_codec_benchmark, samples
from natsched.cli.app import main


def test_both_decoders_read_the_same_fields_from_the_same_bytes():
    for name, (schema, struct, data) in samples().items():
        ours = schema.decode(data)
        theirs = msgspec.msgpack.Decoder(struct).decode(data)
        for f in msgspec.structs.fields(struct):
            assert getattr(theirs, f.name) == getattr(ours, f.name), (name, f.name)


def test_both_refuse_every_malformed_input():
    assert all(ours and theirs for ours, theirs in refusals().values())


def test_the_benchmark_reports_each_message(capsys):
    rows = run_codec_benchmark(n=50, rounds=1)
    assert {r["message"] for r in rows} == set(samples())
    assert all(r["natsched_us"] > 0 and r["msgspec_us"] > 0 for r in rows)
    assert main(["bench", "codec", "--n", "20"]) == 0
    assert "msgspec" in capsys.readouterr().out
