"""bench/spec.py's measurement on a tiny size: drafts on and off give the same greedy tokens, the
copying prompt's drafts are accepted, and the counters the report reads are there; bench/spec_serve.py's
configurations (with and without a llama-server binary) and its comparison, with no server started."""

from __future__ import annotations

import argparse

import pytest

from tandem.bench import spec, spec_serve


def test_run_once_on_equals_off_and_counts(smollm2, one_torch_thread):
    prompt = [spec.COPYING[2]]                       # the tool result quoted back
    off = spec.run_once(smollm2, "off", prompt, 40, "torch")
    on = spec.run_once(smollm2, "ngram", prompt, 40, "torch")
    assert on["ids"] == off["ids"] and on["tokens"] == off["tokens"] > 0
    assert off["drafted"] == off["verify_steps"] == off["declined_steps"] == 0
    assert on["accepted"] > 0 and on["steps"] < off["steps"]


def _serve_args(**kw):
    return argparse.Namespace(**{"modes": "colocated,disaggregated", "threads": 2, "llama_server": "",
                                 "llama_specs": "", "ctx_per_slot": 4096, "max_total_tokens": 16384,
                                 "startup_timeout": 300.0} | kw)


def test_spec_serve_configs_without_and_with_llama_server(tmp_path):
    assert list(spec_serve.configs(_serve_args())) == [
        "tandem colocated off", "tandem colocated ngram", "tandem disaggregated off", "tandem disaggregated ngram"]
    fake = tmp_path / "llama-server"                  # its --help, as llama.cpp prints the flag
    fake.write_text("#!/bin/sh\necho '--spec-type none,draft-simple,ngram-simple,ngram-mod,ngram-cache'\n")
    fake.chmod(0o755)
    made = spec_serve.configs(_serve_args(modes="colocated", llama_server=str(fake)))
    assert list(made) == ["tandem colocated off", "tandem colocated ngram", "llama-server off",
                          "llama-server ngram-simple", "llama-server ngram-mod", "llama-server ngram-cache"]
    assert "--spec-type" not in made["llama-server off"](tmp_path / "a.log").cmd
    assert made["llama-server ngram-mod"](tmp_path / "b.log").cmd[-2:] == ["--spec-type", "ngram-mod"]
    tuned = spec_serve.configs(_serve_args(modes="colocated", llama_server=str(fake),
                                           llama_specs="off;ngram-simple --spec-ngram-simple-size-n 4"))
    assert tuned["llama-server ngram-simple --spec-ngram-simple-size-n 4"](tmp_path / "c.log").cmd[-4:] == [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4"]


def _round(tok_s, ttft, texts, drafted=0, accepted=0):
    return {"tok_s": tok_s, "ttfts": [ttft] * len(texts), "itls": [0.01] * len(texts), "texts": texts, "tokens": [10] * len(texts),
            "drafted": drafted, "accepted": accepted, "wall_s": 1.0}


def test_spec_serve_compare():
    got = {"tandem colocated off": [_round(100, 0.2, ["a", "b"])],
           "tandem colocated ngram": [_round(150, 0.2, ["a", "b"], 20, 10)]}
    rows = {r["config"]: r for r in spec_serve.compare(got, ["colocated"])}      # no llama-server rows
    assert rows["tandem colocated ngram"]["on_off"] == 1.5 and rows["tandem colocated ngram"]["acceptance"] == 0.5
    assert not any("vs_best_llama_ngram" in r for r in rows.values())
    got |= {"llama-server off": [_round(50, 0.1, ["a", "c"])],
            "llama-server ngram-simple": [_round(75, 0.1, ["a", "c"], 8, 4)],
            "llama-server ngram-mod": [_round(60, 0.1, ["a", "d"])]}
    rows = {r["config"]: r for r in spec_serve.compare(got, ["colocated"])}
    assert rows["llama-server ngram-simple"].get("best_llama_ngram")
    assert rows["tandem colocated ngram"]["vs_best_llama_ngram"] == {"tok_s": 2.0, "ttft_p50": 2.0}
    assert rows["tandem colocated ngram"]["texts_equal_to_llama_off"] == "1/2"
    assert rows["llama-server ngram-mod"]["texts_equal_to_llama_off"] == "1/2"
    got["tandem colocated ngram"] = [_round(150, 0.2, ["a", "x"])]
    with pytest.raises(AssertionError, match="differ"):
        spec_serve.compare(got, ["colocated"])
