"""core/kv_messages.py: exact round trips, and malformed bytes rejected with the field named."""

from __future__ import annotations

import msgpack
import pytest

from tandem.core.kv_messages import (
    Abort, Handshake, KVTransferRequest, PrefillResult, RegionInfo, RegionPages, decode_message,
)
from tandem.core.pool_layout import PoolLayout
from tandem.core.transfer_state import TransferState
from tandem.core.types import TokenLogprob

KV = RegionInfo("kv", 0x7F00_0000_1000, 0, "DRAM", PoolLayout(30, 4112, 16, 768))
SWA = RegionInfo("swa", 0x7F00_8000_0000, 1, "VRAM", PoolLayout(4, 1040, 16, 768))
HS = Handshake("decode-0", b"\x00nixl-md\xff", (KV, SWA))
REQ = KVTransferRequest(2**62 + 5, "decode-0", (RegionPages("kv", (3, 4, 9)), RegionPages("swa", (1,))),
                        deadline=1_800_000_000.25)


def _wire(msg) -> dict:
    return msgpack.unpackb(msg.encode(), raw=False)


def _bytes(d: dict) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize("msg", [
    HS, REQ,
    KVTransferRequest(1, "d", (), deadline=0),
    KVTransferRequest(1, "d", (), deadline=0, digest=True),
    PrefillResult(7, TransferState.DONE, "prefill-0", first_token=42, bytes=4096, pages=2,
                  cached_tokens=16, prefill_s=0.5, transfer_s=0.01, digest="ab12"),
    PrefillResult(7, TransferState.FAILED, "prefill-0", error="prefill worker died", in_flight=True),
    PrefillResult(7, TransferState.ABORTED, "prefill-0", error="client went away"),
    PrefillResult(7, TransferState.DONE, "prefill-0", first_token=42, first_logprob=-0.25,
                  first_top_logprobs=((42, -0.25), (7, -1.5))),
    PrefillResult(7, TransferState.DONE, "prefill-0", first_token=42, first_logprob=0.0),
    PrefillResult(7, TransferState.DONE, "prefill-0", first_token=42, prompt_logprobs=(
        TokenLogprob(5, -1.5, (), 3), TokenLogprob(9, -0.5, ((9, -0.5), (4, -2.0)), 1))),
    Abort(9, "client went away"),
])
def test_round_trip(msg):
    data = msg.encode()
    assert isinstance(data, bytes) and len(data) < 512
    assert decode_message(data) == msg
    assert type(msg).decode(data) == msg


def test_accessors():
    assert HS.region("swa") is SWA
    assert REQ.pages("kv") == (3, 4, 9) and REQ.regions == ("kv", "swa")
    with pytest.raises(KeyError, match="no region 'mamba'"):
        HS.region("mamba")
    with pytest.raises(ValueError, match="repeats a region"):
        KVTransferRequest(1, "d", (RegionPages("kv", (1,)), RegionPages("kv", (2,))), 0.0)


def test_decode_as_the_wrong_class():
    with pytest.raises(ValueError, match="expected a PrefillResult, got a Abort"):
        PrefillResult.decode(Abort(1).encode())


def test_prefill_result_ok_only_when_done():
    assert PrefillResult(1, TransferState.DONE, "p").ok
    assert not PrefillResult(1, TransferState.FAILED, "p").ok


@pytest.mark.parametrize("data, match", [
    (b"", "not a msgpack message"),
    (b"\xc1garbage", "not a msgpack message"),
    (_bytes([1, 2]), "missing field 'type'"),
    (_bytes({"type": "pickle"}), "unknown type 'pickle'"),
    ("text", "expected bytes"),
])
def test_rejects_non_messages(data, match):
    with pytest.raises(ValueError, match=match):
        decode_message(data)


def _mutate(msg, **changes) -> bytes:
    d = _wire(msg)
    for k, v in changes.items():
        if v is ...:
            del d[k]
        else:
            d[k] = v
    return _bytes(d)


@pytest.mark.parametrize("data, match", [
    (_mutate(REQ, transfer_id="7"), "KVTransferRequest.transfer_id must be an int"),
    (_mutate(REQ, transfer_id=True), "KVTransferRequest.transfer_id must be an int"),
    (_mutate(REQ, transfer_id=-1), "KVTransferRequest.transfer_id must be an int >= 0"),
    (_mutate(REQ, deadline=...), "KVTransferRequest: missing field 'deadline'"),
    (_mutate(REQ, deadline="soon"), "KVTransferRequest.deadline must be a finite number"),
    (_mutate(REQ, deadline=float("nan")), "KVTransferRequest.deadline must be a finite number"),
    (_mutate(REQ, extra=1), "KVTransferRequest: unknown field 'extra'"),
    (_mutate(REQ, agent_name=""), "KVTransferRequest.agent_name must be a non-empty str"),
    (_mutate(REQ, dst_pages=[1, 2]), "KVTransferRequest.dst_pages must be a map"),
    (_mutate(REQ, dst_pages={"kv": [1, "2"]}), r"KVTransferRequest.dst_pages\['kv'\]\[1\] must be an int"),
    (_mutate(REQ, dst_pages={"kv": 5}), r"KVTransferRequest.dst_pages\['kv'\] must be a list"),
    (_mutate(REQ, digest=1), "KVTransferRequest.digest must be a bool"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p"), status="transferring"), "PrefillResult.status must be one of"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p"), first_token=1.5), "PrefillResult.first_token must be an int"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p"), error=None), "PrefillResult.error must be a str"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p"), in_flight=0), "PrefillResult.in_flight must be a bool"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p"), bytes=...), "PrefillResult: missing field 'bytes'"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p", first_token=3), first_logprob=0.5),
     r"PrefillResult.first_logprob must be a log-probability \(<= 0\)"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p", first_token=3), first_logprob=float("-inf")),
     "PrefillResult.first_logprob must be a finite number"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p"), first_logprob=-1.0),
     "PrefillResult.first_logprob must be None without a first_token"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p", first_token=3), first_top_logprobs=[[3, -0.1]]),
     "PrefillResult.first_top_logprobs must be empty without a first_logprob"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p", first_token=3, first_logprob=-0.1),
             first_top_logprobs=[[3]]), r"PrefillResult.first_top_logprobs\[0\] must be a \[token id, logprob\] pair"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p", first_token=3, first_logprob=-0.1),
             first_top_logprobs=[["a", -0.1]]), r"PrefillResult.first_top_logprobs\[0\]\[0\] must be an int"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p", first_token=3, first_logprob=-0.1),
             first_top_logprobs=7), "PrefillResult.first_top_logprobs must be a list"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p"), first_logprob=...),
     "PrefillResult: missing field 'first_logprob'"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p", first_token=3), prompt_logprobs=[[5, -1.0, 0, []]]),
     r"PrefillResult.prompt_logprobs\[0\]\[2\] must be an int >= 1"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p", first_token=3), prompt_logprobs=[[5, -1.0, 1]]),
     r"PrefillResult.prompt_logprobs\[0\] must be a \[token id, logprob, rank, alternatives\] list"),
    (_mutate(PrefillResult(1, TransferState.DONE, "p", first_token=3), prompt_logprobs=[[5, 1.0, 1, []]]),
     r"PrefillResult.prompt_logprobs\[0\]\[1\] must be a log-probability"),
    (_mutate(Abort(1), reason=3), "Abort.reason must be a str"),
    (_mutate(HS, agent_metadata="text"), "Handshake.agent_metadata must be non-empty bytes"),
    (_mutate(HS, regions={"kv": 1}), "Handshake.regions must be a list"),
    (_mutate(HS, regions=[KV.to_wire(), KV.to_wire()]), "Handshake.regions repeats a name"),
    (_mutate(HS, regions=[{**KV.to_wire(), "rows": 0}]), "RegionInfo.rows must be an int >= 1"),
    (_mutate(HS, regions=[{**KV.to_wire(), "mem_type": "HBM"}]), "RegionInfo.mem_type must be"),
    (_mutate(HS, regions=[{**KV.to_wire(), "rows": 4113}]), "rows=4113 is not a multiple of page_size=16"),
    (_mutate(HS, regions=[{"name": "kv"}]), "RegionInfo: fields must be"),
])
def test_rejects_malformed_fields(data, match):
    with pytest.raises(ValueError, match=match):
        decode_message(data)
