"""Batch invariance of every CPU linear kernel at every instruction-set level this CPU offers
(issue 50), and the oneDNN cap that makes it hold on AMX CPUs (core/onednn.py).

oneDNN reads its ISA cap once per process, so each level runs in a child process with
``ONEDNN_MAX_CPU_ISA`` set: AVX2, AVX512, AVX512-BF16 and AMX where the CPU has them, and the
product's own pin (the variable unset). AMX asked for explicitly must be replaced by the pin: the
child's oneDNN log (``ONEDNN_VERBOSE``) then names no AMX kernel. Inputs come from fixed seeds, so
a failure fails every run, not 6 in 8.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem.core import onednn as isa
from tandem.engine.quant.cpu import cpu_flags

ROWS = (1, 2, 3, 4, 5, 16, 33, 70)

# The child: every kernel make_linear can pick here, fp32 and bf16, each output row of a 70-row
# batch compared bitwise with the row computed alone and in every smaller batch, at 1 and 2 threads,
# with and without a fused residual add (a padded small batch once added it after rounding).
CHILD = r"""
import json, sys
import tandem, torch
from tandem.engine.quant.blocks import from_gguf_blocks
from tandem.engine.quant.linear import make_linear, onednn_packable
import gguf, numpy as np

rows = json.loads(sys.argv[1])
cpu = torch.device("cpu")
rng = np.random.default_rng(50)
n, k = 256, 576
w = rng.standard_normal((n, k)).astype(np.float32)
raw = gguf.quants.quantize(w * 0.05, gguf.GGMLQuantizationType.Q4_1)
qw = from_gguf_blocks("Q4_1", raw, n, k)
cases = [("fp32", make_linear(torch.from_numpy(w), torch.float32, cpu)[0], torch.float32)]
if onednn_packable(torch.bfloat16, cpu):
    cases.append(("bf16-dense", make_linear(torch.from_numpy(w), torch.bfloat16, cpu)[0], torch.bfloat16))
for native in ("int4", True):
    lin, why = make_linear(qw, torch.bfloat16, cpu, native=native)
    if why is None:
        cases.append((f"bf16-{native}", lin, torch.bfloat16))
torch.manual_seed(50)
x = torch.randn(max(rows), k)
res = torch.randn(max(rows), n)
bad = []
for threads in (1, 2):
    torch.set_num_threads(threads)
    for name, lin, dtype in cases:
        xs, rs = x.to(dtype), res.to(dtype)
        alone = torch.cat([lin(xs[i:i + 1]) for i in range(max(rows))])
        fused = torch.cat([lin(xs[i:i + 1], residual=rs[i:i + 1].clone()) for i in range(max(rows))])
        for m in rows:
            if not torch.equal(lin(xs[:m]), alone[:m]):
                bad.append([name, type(lin).__name__, threads, m])
            if not torch.equal(lin(xs[:m], residual=rs[:m].clone()), fused[:m]):
                bad.append([name + "+residual", type(lin).__name__, threads, m])
print("RESULT " + json.dumps({"cases": [[c[0], type(c[1]).__name__] for c in cases], "bad": bad}))
"""


def _child(level: str | None) -> tuple[dict, list[str]]:
    """Run CHILD with ``ONEDNN_MAX_CPU_ISA=level`` (None: unset); (its result, oneDNN's kernels)."""
    env = {k: v for k, v in os.environ.items() if k != isa.VAR}
    env["ONEDNN_VERBOSE"] = "1"
    if level is not None:
        env[isa.VAR] = level
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(ROWS)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout.splitlines()
    result = json.loads(next(line for line in out if line.startswith("RESULT "))[len("RESULT "):])
    kernels = sorted({line.split(",")[6] for line in out
                      if line.startswith("onednn_verbose") and ",exec," in line and len(line.split(",")) > 6})
    return result, kernels


def _levels() -> list[str | None]:
    flags = cpu_flags()
    return [None] + [lv for lv, need in isa.TESTED_LEVELS.items() if all(f in flags for f in need)]


@pytest.mark.parametrize("level", _levels(), ids=lambda lv: lv or "pinned")
def test_every_kernel_is_row_independent_at_every_isa_level(level):
    result, kernels = _child(level)
    assert result["cases"], "no kernel was built"
    assert not result["bad"], f"rows that depend on their batch at {level or 'the pin'}: {result['bad']} ({kernels})"
    assert not any("amx" in k for k in kernels), f"an AMX kernel ran at {level or 'the pin'}: {kernels}"


def test_the_cap_is_read_after_torch_is_imported():
    """The mechanism the pin rests on: oneDNN takes the variable at its first primitive, so setting
    it after ``import torch`` (as tandem/__init__.py does) is in time."""
    code = ("import os, torch\nos.environ['ONEDNN_MAX_CPU_ISA'] = 'SSE41'\n"
            "w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 128), 32)\n"
            "torch.ops.mkldnn._linear_pointwise(torch.randn(8, 128), w, None, 'none', [], '')\n")
    env = {**{k: v for k, v in os.environ.items() if k != isa.VAR}, "ONEDNN_VERBOSE": "1"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "isa:Intel SSE4.1" in p.stdout, p.stdout[:2000]


def test_pin_keeps_lower_levels_and_replaces_higher_ones():
    env: dict[str, str] = {}
    assert isa.pin_onednn_isa(env) == isa.CAP and env[isa.VAR] == isa.CAP
    env = {isa.VAR: "avx2"}
    assert isa.pin_onednn_isa(env) == "AVX2" and env[isa.VAR] == "AVX2"
    for above in ("ALL", "DEFAULT", "AVX512_CORE_AMX", "AVX10_1_512_AMX", "AVX512_CORE_FP16"):
        env = {isa.VAR: above}
        assert isa.pin_onednn_isa(env) == isa.CAP and env[isa.VAR] == isa.CAP


def test_this_process_is_pinned():
    assert os.environ.get(isa.VAR) in isa.AT_OR_BELOW_CAP
    assert os.environ[isa.VAR] in isa.describe()
