"""engine/models/llama_cpu.py: the fused Llama layer (one C call) is bitwise the unfused layer.

On the real SmolLM2 in the default numerics (bf16 + the GGUF's Q4_1 blocks on AVX512, the
cpu_kernel attention backend): a prompt in chunks, then decode steps next to another sequence,
logits compared bit for bit with every layer run unfused (``layer.fused = None``), at 1 and 2
threads. Skipped where the fused path does not apply here (no AVX512 kernels).
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from tandem.engine.attention import make_attention_backend
from tandem.engine.models.llama_cpu import FusedLlamaLayer
from tandem.engine.model_runner import ModelRunner
from tandem.engine.quant.native_lib import kernel_unavailable

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None, reason=f"needs the AVX512-BF16 kernels: {kernel_unavailable()}")


def _trace(loaded, fused: bool | None) -> list[torch.Tensor]:
    """Logits of a fixed little workload; ``fused`` True/False forces every layer's form, None
    leaves the layers as they are."""
    layers = loaded.model.layers if fused is not None else []
    for layer in layers:
        layer.fused, layer.fused_built = (FusedLlamaLayer.build(layer) if fused else None), True
    r = ModelRunner.create(loaded, max_total_tokens=2048, max_reqs=4, max_context=1024,
                           backend=make_attention_backend("cpu_kernel", torch.device("cpu")))
    tok = loaded.tokenizer
    a, b = tok.encode("The capital of France is"), tok.encode(" ".join(f"w{i}" for i in range(30)))
    sa, sb = r.new_seq(), r.new_seq()
    out = [r.extend([sa], [a[:2]]), r.extend([sa, sb], [a[2:], b])]
    ta, tb = out[-1].argmax(-1).tolist()
    for _ in range(5):
        lg = r.decode([sa, sb], [ta, tb])
        out.append(lg)
        ta, tb = lg.argmax(-1).tolist()
    r.release(sa)
    r.release(sb)
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_layer_is_bitwise_the_unfused_one(smollm2_default, threads, monkeypatch):
    if FusedLlamaLayer.build(smollm2_default.model.layers[0]) is None:
        pytest.skip("the default model's layers are not fusable here")
    ran, call = [], FusedLlamaLayer.__call__
    monkeypatch.setattr(FusedLlamaLayer, "__call__", lambda self, *a: ran.append(1) or call(self, *a))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = _trace(smollm2_default, True)
        assert len(ran) == 7 * len(smollm2_default.model.layers)   # every layer of every step fused
        plain = _trace(smollm2_default, False)
        assert len(ran) == 7 * len(smollm2_default.model.layers)   # ... and none here
    finally:
        for layer in smollm2_default.model.layers:
            layer.fused, layer.fused_built = FusedLlamaLayer.build(layer), True
        torch.set_num_threads(old)
    assert len(fused) == len(plain)
    for i, (f, p) in enumerate(zip(fused, plain)):
        assert torch.equal(f, p), f"step {i} differs"


def test_a_pickled_model_rebuilds_its_fused_layers_and_computes_the_same(smollm2_default):
    """Ray ships models to workers pickled: the fused form (holding the layer's weight tensors) is rebuilt there."""
    model = smollm2_default.model
    again = pickle.loads(pickle.dumps(model))
    assert all(layer.fused is None and not layer.fused_built for layer in again.layers)
    b = _trace(dataclasses.replace(smollm2_default, model=again), None)   # None: as unpickled
    a = _trace(smollm2_default, True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    built = again.layers[0].fused
    assert built is not None and built.weights[0].data_ptr() == again.layers[0].qkv.packed.data_ptr()


def test_the_torch_backend_runs_the_layer_unfused(smollm2_default):
    """Another backend: the fused call declines (returns None) and the layer runs as written."""
    layer = smollm2_default.model.layers[0]
    fused = FusedLlamaLayer.build(layer)
    x = torch.randn(1, layer.o_proj.out_features).bfloat16()
    cos = torch.zeros(1, 1, layer.d // 2).bfloat16()
    assert fused(x, cos, cos, None, make_attention_backend("torch", torch.device("cpu"))) is None
