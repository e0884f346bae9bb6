"""bench codec times what services run, on input the engine reads right: each sample decodes to
the message it was encoded from, and every malformed input the benchmark names is refused."""

from __future__ import annotations

from natsched.bench.codec import refusals, run_codec_benchmark, samples
from natsched.cli.app import main


def test_each_sample_decodes_to_the_message_it_encodes():
    for name, (schema, data) in samples().items():
        assert schema.decode(data).encode() == data, name


def test_every_malformed_input_is_refused_naming_why():
    refused = refusals()
    assert all(refused.values()), refused
    assert "token id" in refused["a token id past 2^31"] and "'max_tokens'" in refused["max_tokens a string"]


def test_the_benchmark_reports_each_message(capsys):
    rows = run_codec_benchmark(n=50, rounds=1)
    assert {r["message"] for r in rows} == set(samples())
    assert all(r["natsched_us"] > 0 and r["struct_us"] > 0 and r["encode_us"] > 0 for r in rows)
    assert main(["bench", "codec", "--n", "20"]) == 0
    assert "natsched µs" in capsys.readouterr().out
