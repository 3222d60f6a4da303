"""Weights shared through the object store (cluster/weights.py): a LoadedModel comes back whole
(tied tensors one tensor, parameters parameters); an engine in a Ray actor serving from the
store's mapped weights gives the driver's greedy tokens, and after it served, the store's copy is
still bitwise the driver's (the workers only read it); the same object is put once."""

from __future__ import annotations

import pytest

from tandem.cluster.weights import Shared, share
from tandem.core.config import CacheConfig, EngineConfig

torch = pytest.importorskip("torch")
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CONFIG = EngineConfig(device="cpu", num_threads=1, cache=CacheConfig(page_size=16, max_total_tokens=2048))


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(3, dtype=torch.bfloat16))
        self.view = torch.arange(12.0).reshape(3, 4).t()     # not contiguous


def test_a_model_comes_back_whole():
    m = Tied()
    back = pickle_round_trip(Shared(m))
    assert back.head.weight is back.embed.weight
    assert isinstance(back.embed.weight, torch.nn.Parameter) and back.embed.weight.requires_grad
    for a, b in ((m.embed.weight, back.embed.weight), (m.scale, back.scale), (m.view, back.view)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def pickle_round_trip(obj):
    import pickle

    return pickle.loads(pickle.dumps(obj, protocol=5))


def _dense(t):
    return t.to_dense() if t.is_mkldnn else t


def test_an_actor_serves_from_the_stores_weights_and_leaves_them_intact(ray_local, smollm2):
    ray = ray_local
    ref = share(smollm2)
    assert share(smollm2) is ref

    def greedy(loaded, config, prompts) -> list[list[int]]:    # local: Ray ships it by value
        from tandem.core.types import SamplingParams
        from tandem.engine.engine import Engine

        engine = Engine(config, loaded=loaded)
        try:
            return [engine.generate(p, SamplingParams(max_tokens=6, ignore_eos=True)).token_ids for p in prompts]
        finally:
            engine.shutdown()

    served = ray.remote(num_cpus=1)(greedy).remote(ref, CONFIG, PROMPTS)
    assert ray.get(served, timeout=300) == greedy(smollm2, CONFIG, PROMPTS)
    ours, stored = smollm2.model.state_dict(), ray.get(ref).model.state_dict()
    assert ours.keys() == stored.keys()
    for name, t in ours.items():
        assert torch.equal(_dense(t), _dense(stored[name])), name
