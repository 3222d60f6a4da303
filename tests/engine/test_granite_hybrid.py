"""Granite-4.0-H (``GraniteMoeHybridForCausalLM``) from a HF directory: Mamba2 layers beside
attention, their state (conv window + SSM state) in the engine's state pool.

Tiny random models (layers mamba, attention, mamba, mamba; 8 Mamba heads in 2 groups, d_state 8,
conv width 4, SSD chunk 8; Granite's four multipliers != 1), in two variants: dense MLP with
rotary, and MoE (4 experts, top 2) without positions ("nope", as Granite-4.0-H ships):

- the SSD chunk scan and the conv window, carried across calls, equal a token-by-token recurrence;
- logits equal transformers' torch fallback (measured max |diff| <= 5e-6; asserted within 1e-4)
  one-shot, and in chunks + decode steps carrying the state row, batched with another sequence;
- the Engine (chunked_prefill_size 16, page sizes 1 and 4, prefix cache on and off, every
  invariant checked) gives transformers' greedy tokens over multi-turn sessions; with the cache
  on, later turns resume from recurrent-state checkpoints, also when checkpoints must be evicted
  to admit requests (six state rows for three sessions).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tandem.engine.loader import load_model  # noqa: E402
from tandem.engine.model_config import ModelLoadError  # noqa: E402
from tandem.engine.models.granite_hybrid import granite_hybrid_arch  # noqa: E402
from tandem.engine.models.ssd import causal_conv1d, causal_conv1d_step, ssd_scan, ssd_step  # noqa: E402
from tandem.engine.models.state_layout import StateLayout  # noqa: E402

from hf_hybrid_support import (engine_sessions, hf_greedy, make_engine, randomize,  # noqa: E402
                               save_hf, StateRunner)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [(7 * i + 3) % 256 for i in range(37)]
ATOL = 1e-4
VARIANTS = {"dense_rope": dict(num_local_experts=0, position_embedding_type="rope"),
            "moe_nope": dict(num_local_experts=4, num_experts_per_tok=2, position_embedding_type=None)}


def granite_config(**kw):
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=32, shared_intermediate_size=96,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8,
                mamba_n_groups=2, mamba_d_state=8, mamba_d_head=16, mamba_d_conv=4,
                mamba_chunk_size=8, embedding_multiplier=1.5, residual_multiplier=0.7,
                attention_multiplier=0.2, logits_scaling=1.3, bos_token_id=256, eos_token_id=257,
                max_position_embeddings=256)
    return transformers.GraniteMoeHybridConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def granite(request, tmp_path_factory):
    """(transformers model, Tandem LoadedModel, reference logits [T, V] of PROMPT)."""
    torch.manual_seed(0)
    hf = transformers.GraniteMoeHybridForCausalLM(granite_config(**VARIANTS[request.param])).eval()
    randomize(hf)
    path = tmp_path_factory.mktemp(request.param)
    save_hf(hf, path)
    loaded = load_model(str(path), device="cpu", dtype="float32")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    return hf, loaded, ref


# -- the recurrences -------------------------------------------------------------------------------
def _sequential(x, dt, A, B, C, state):
    ys = []
    for t in range(x.shape[0]):
        y, state = ssd_step(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], state)
        ys.append(y)
    return torch.cat(ys), state


def test_ssd_scan_and_conv_carry_state_exactly():
    g = torch.Generator().manual_seed(1)
    n, H, P, N = 21, 3, 4, 5
    x, B, C = (torch.randn(n, H, d, generator=g) for d in (P, N, N))
    dt = torch.rand(n, H, generator=g) * 0.5
    A = -torch.linspace(0.5, 4.0, H)
    s0 = torch.randn(1, H, P, N, generator=g)
    y_ref, s_ref = _sequential(x, dt, A, B, C, s0)
    for chunk in (1, 4, 8, 32):                         # chunks that do and do not divide n
        y, s = ssd_scan(x, dt, A, B, C, s0[0], chunk)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s, s_ref[0], atol=1e-5, rtol=1e-5)
    y1, s1 = ssd_scan(x[:9], dt[:9], A, B[:9], C[:9], s0[0], 4)   # split in two calls
    y2, s2 = ssd_scan(x[9:], dt[9:], A, B[9:], C[9:], s1, 4)
    torch.testing.assert_close(torch.cat([y1, y2]), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s2, s_ref[0], atol=1e-5, rtol=1e-5)

    Cc, K = 6, 4
    xs, w, b = torch.randn(n, Cc, generator=g), torch.randn(Cc, K, generator=g), torch.randn(Cc, generator=g)
    whole, _ = causal_conv1d(xs, torch.zeros(Cc, K - 1), w, b)
    ref = torch.nn.functional.conv1d(xs.t()[None], w[:, None], b, padding=K - 1, groups=Cc)[0, :, :n].t()
    torch.testing.assert_close(whole, ref)               # zero window == transformers' zero padding
    a, win = causal_conv1d(xs[:2], torch.zeros(Cc, K - 1), w, b)       # shorter than the window
    c, win = causal_conv1d(xs[2:10], win, w, b)
    steps = []
    for t in range(10, n):
        yt, win3 = causal_conv1d_step(xs[t:t + 1], win[None], w, b)
        win = win3[0]
        steps.append(yt)
    torch.testing.assert_close(torch.cat([a, c, *steps]), ref, atol=1e-5, rtol=1e-5)


def test_state_layout_packs_conv_and_ssm():
    lay = StateLayout({"conv": (6, 3), "ssm": (2, 4, 5)})
    assert lay.numel == 18 + 40
    rows = torch.zeros(3, lay.numel)
    lay.view(rows, "ssm")[1] = 1.0                       # a view: writes land in the row
    assert rows[1, 18:].eq(1).all() and rows[1, :18].eq(0).all() and rows[0].eq(0).all()
    packed = lay.pack(conv=lay.view(rows, "conv"), ssm=lay.view(rows, "ssm"))
    assert torch.equal(packed, rows)


# -- config ----------------------------------------------------------------------------------------
def test_config_parsed(granite):
    hf, loaded, _ = granite
    a, ex, m = loaded.arch, loaded.model.extras, loaded.model
    assert a.arch == "granitemoehybrid" and a.layer_types == ["mamba", "full", "mamba", "mamba"]
    assert ex.rope == (hf.config.position_embedding_type == "rope")
    assert ex.num_experts == hf.config.num_local_experts and a.intermediate_size == 96
    d = ex.mamba
    assert (d.n_heads, d.head_dim, d.n_groups, d.d_state, d.d_conv, d.chunk_size) == (8, 16, 2, 8, 4, 8)
    assert d.time_step_max == float("inf")               # written as {"__float__": "Infinity"}
    assert m.recurrent_layers == [0, 2, 3]
    assert m.state_shape == (d.conv_dim * 3 + 8 * 16 * 8,)   # conv [160, K-1] + ssm [8, 16, 8]


def test_legacy_config_layout():
    """Hub configs of Granite-4.0-H: "mamba"/"attention" layer names, "nope", rope_theta on top."""
    cfg = {"architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 300, "hidden_size": 64,
           "num_hidden_layers": 3, "num_attention_heads": 4, "layer_types": ["mamba", "attention", "mamba"],
           "position_embedding_type": "nope", "rope_theta": 10000, "mamba_n_heads": 8,
           "mamba_d_head": "auto", "time_step_limit": [0.0, float("inf")], "num_local_experts": 0,
           "shared_intermediate_size": 96}
    arch, ex = granite_hybrid_arch(cfg)
    assert arch.layer_types == ["mamba", "full", "mamba"] and not ex.rope and ex.mamba.head_dim == 16
    with pytest.raises(ModelLoadError, match="layer_types"):
        granite_hybrid_arch({**cfg, "layer_types": ["mamba", "moe", "mamba"]})
    with pytest.raises(ModelLoadError, match="mamba heads 7"):
        granite_hybrid_arch({**cfg, "mamba_n_heads": 7, "mamba_d_head": 16})


# -- logits ----------------------------------------------------------------------------------------
def test_prefill_logits_match_hf(granite):
    _, loaded, ref = granite
    r = StateRunner(loaded)
    got = r.extend([r.new_seq()], [PROMPT], all_logits=True)              # [T, V]
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_pickled_model_gives_the_same_logits(granite):
    """The cluster ships a loaded model to its workers with ray.put (pickle)."""
    import pickle

    _, loaded, ref = granite
    r = StateRunner(pickle.loads(pickle.dumps(loaded)))
    got = r.extend([r.new_seq()], [PROMPT], all_logits=True)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_and_decode_match_hf(granite, page_size):
    """Seq A: chunks [0, 2) (shorter than the conv window) [2, 19) [19, 30), then decode to 37;
    seq B runs beside it one token at a time (decode rows batched with prompt chunks)."""
    _, loaded, ref = granite
    r = StateRunner(loaded, page_size)
    a, b = r.new_seq(), r.new_seq()
    got_a, got_b = [], []
    for (lo, hi), t in zip([(0, 2), (2, 19), (19, 30)], range(3)):
        lg = r.extend([a, b], [PROMPT[lo:hi], PROMPT[t:t + 1]], all_logits=True)
        got_a.append(lg[: hi - lo])
        got_b.append(lg[hi - lo:])
    for t in range(30, len(PROMPT)):
        lg = r.extend([b, a], [[PROMPT[t - 27]], [PROMPT[t]]])             # other order too
        got_b.append(lg[:1])
        got_a.append(lg[1:])
    torch.testing.assert_close(torch.cat(got_a), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), ref[:10], atol=ATOL, rtol=0)


# -- through the engine ----------------------------------------------------------------------------
@pytest.mark.parametrize("disable", [False, True], ids=["cache", "nocache"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_engine_greedy_matches_hf(granite, page_size, disable):
    hf, loaded, _ = granite
    e = make_engine(loaded, page_size=page_size, disable=disable)
    try:
        sessions = engine_sessions(e)
        e.check_invariants()   # also checked after every step
        hstats = dict(e.hybrid.stats)
        assert e.hybrid.state_pool.data.shape[-1] == loaded.model.state_shape[0]
    finally:
        e.shutdown()
    for sess in sessions:
        for prompt, out, cached in sess:
            assert out == hf_greedy(hf, prompt, len(out))
            assert cached == 0 or not disable
    later = [c for sess in sessions for _, _, c in sess[1:]]
    if disable:
        assert sum(later) == 0
    else:   # each later turn resumes from a checkpoint: the previous turn's page-aligned end
        assert all(c > 0 and c % page_size == 0 for c in later), later
        assert hstats["checkpoints"] > 0


def test_engine_under_state_pressure_matches_hf(granite):
    """Six state rows for three sessions (each running request holds a working and a track row):
    cached checkpoints are evicted to admit requests, outputs stay transformers'."""
    hf, loaded, _ = granite
    e = make_engine(loaded, page_size=4, disable=False, state_slots=6)
    try:
        sessions = engine_sessions(e, n_sessions=3)
        e.check_invariants()
        hstats = dict(e.hybrid.stats)
    finally:
        e.shutdown()
    for sess in sessions:
        for prompt, out, _ in sess:
            assert out == hf_greedy(hf, prompt, len(out))
    assert hstats["state_evicted"] > 0 and hstats["checkpoints"] > 0
    assert sum(c for sess in sessions for _, _, c in sess) > 0
