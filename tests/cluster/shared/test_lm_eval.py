"""lm-evaluation-harness against Tandem (issue 41): its ``local-completions`` model talks to the front
door over a real 1 prefill + 1 decode cluster (Ray actors, NIXL, SmolLM2 in float32: the worker set
these modules share, tests/cluster/shared/conftest.py), with a
tokenizer made from the GGUF; the reference is lm-eval's own ``hf`` model on the same weights
(transformers, float32).

The tasks live in tests/cluster/shared/lm_eval_tasks/ over a local JSON-lines file (``dataset_path: json``,
``data_files`` relative to that directory, which the tests run from), with the hub offline:
- ``tandem_capitals_mc``: multiple choice, i.e. loglikelihood requests, which local-completions
  answers from ``echo`` + ``logprobs`` (the prompt's logprobs computed by the prefill worker and
  carried to decode with the KV); every choice's loglikelihood and is-greedy flag must equal the
  hf model's within 1e-3, one prompt a request and four (lm-eval's ``batch_size``);
- ``tandem_capitals_gen``: generate_until, run to the end; its greedy answers equal the hf model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
lm_eval = pytest.importorskip("lm_eval")

from serve_support import Server  # noqa: E402

# the first test also starts the cluster and loads transformers' model: on the loaded shared box
# the module has taken over 8 minutes, more than the suite's default per-test limit allows for one
pytestmark = pytest.mark.timeout(900)

TASKS = Path(__file__).parent / "lm_eval_tasks"
TOL = 1e-3


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """The hub offline for lm-eval's datasets and transformers; run from the tasks' directory."""
    mp = pytest.MonkeyPatch()
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        mp.setenv(name, "1")
    mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
    import datasets.config

    mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", Path(str(tmp_path_factory.mktemp("hf-datasets-cache"))))
    mp.chdir(TASKS)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def tokenizer_dir(hf_smollm2_tokenizer, tmp_path_factory) -> str:
    """SmolLM2's tokenizer, made by transformers from the GGUF, saved where lm-eval loads it."""
    d = tmp_path_factory.mktemp("smollm2-tokenizer")
    hf_smollm2_tokenizer.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def served(smollm2_1p1d):
    backend = smollm2_1p1d.router()                          # float32, dequantized weights
    server = Server(backend, smollm2_1p1d.base)
    yield backend, server
    server.stop()
    backend.close()


@pytest.fixture(scope="module")
def tasks():
    """lm-eval's task index of TASKS alone (its built-in tasks not indexed: thousands of YAML files)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=False)


def _evaluate(lm, task: str, tasks) -> list[dict]:
    """lm-eval's samples of ``task`` (doc order) under model ``lm``, from the index ``tasks``."""
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tasks, log_samples=True, bootstrap_iters=0)
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def _tandem_lm(served, tokenizer_dir, batch_size: int = 1):
    """lm-eval's local-completions on the served cluster; ``batch_size`` > 1 sends that many prompts
    in one request (a batch of token-id lists)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    backend, server = served
    return LocalCompletionsAPI(base_url=server.url + "/v1/completions", model=backend.model_name,
                               tokenizer=tokenizer_dir, tokenizer_backend="huggingface", batch_size=batch_size,
                               tokenized_requests=True, num_concurrent=1, max_retries=1, timeout=300)


@pytest.fixture(scope="module")
def tandem_lm(served, tokenizer_dir, offline):
    return _tandem_lm(served, tokenizer_dir)


@pytest.fixture(scope="module")
def hf_lm(hf_smollm2, hf_smollm2_tokenizer, offline):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=hf_smollm2, tokenizer=hf_smollm2_tokenizer, batch_size=1)


def _remote_prefills(server) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "tandem_decode_prefill"
               for s in f.samples if s.name.endswith("_total") and s.labels.get("path") == "remote")


@pytest.mark.parametrize("batch_size", [1, 4])
def test_loglikelihood_equals_transformers(served, tokenizer_dir, offline, hf_lm, tasks, batch_size):
    _, server = served
    before = _remote_prefills(server)
    lm = _tandem_lm(served, tokenizer_dir, batch_size)
    got, want = _evaluate(lm, "tandem_capitals_mc", tasks), _evaluate(hf_lm, "tandem_capitals_mc", tasks)
    if batch_size == 1:     # the second run finds the prompts in the caches
        assert _remote_prefills(server) - before >= 12    # 4 questions x 3 choices, each prefilled remotely
    assert [s["doc_id"] for s in got] == [s["doc_id"] for s in want] == [0, 1, 2, 3]
    for g, w in zip(got, want):
        g_lls, w_lls = [r[0] for r in g["filtered_resps"]], [r[0] for r in w["filtered_resps"]]
        assert len(g_lls) == 3 and all(ll < 0 for ll in g_lls)
        assert max(abs(a - b) for a, b in zip(g_lls, w_lls)) < TOL, (g["doc_id"], g_lls, w_lls)
        assert [r[1] for r in g["filtered_resps"]] == [r[1] for r in w["filtered_resps"]]
        assert g["acc"] == w["acc"]


def test_generate_until_runs_to_the_end(tandem_lm, hf_lm, tasks):
    got, want = _evaluate(tandem_lm, "tandem_capitals_gen", tasks), _evaluate(hf_lm, "tandem_capitals_gen", tasks)
    assert len(got) == 4
    answers, ref = [s["filtered_resps"][0] for s in got], [s["filtered_resps"][0] for s in want]
    assert all(isinstance(a, str) and a.strip() and "\n" not in a for a in answers), (answers, ref)
    assert answers == ref
