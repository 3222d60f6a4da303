"""Tokenizer and chat template from a GGUF or a Hugging Face directory, without torch; a user's
error raises :class:`TokenizerError` naming the file or key.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NoReturn

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from tandem.core.chat_templates import GEMMA_TEMPLATE
from tandem.core.types import TandemError

if TYPE_CHECKING:
    import jinja2

_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex (as transformers maps them); anything else keeps GPT-2's regex.
_PRE_SPLITS = {
    **{k: _LLAMA3_SPLIT for k in ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe")},
    **{k: _QWEN2_SPLIT for k in ("qwen2", "deepseek-r1-qwen", "megrez")},
}


class TokenizerError(TandemError):
    """The tokenizer files are missing or malformed, or a chat template failed to render."""


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells tokens with it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {ch: b for b, ch in _bytes_to_unicode().items()}


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the model's special ids and chat template."""

    def __init__(self, backend: _HFTokenizer, *, name: str, bos_token_id: int | None,
                 eos_token_ids: set[int], chat_template: str | None = None,
                 special_tokens: dict[str, str | None] | None = None, add_bos_token: bool = False):
        self._tok = backend
        self._name = name
        self._bos = bos_token_id
        self._eos = set(eos_token_ids)
        self.chat_template = chat_template
        # bos_token / eos_token / unk_token / pad_token strings, passed to the chat template.
        self.special_tokens: dict[str, str | None] = dict(special_tokens or {})
        self.add_bos_token = add_bos_token

    @classmethod
    def from_gguf(cls, path_or_reader: Any) -> "Tokenizer":
        """Build from a GGUF file path or an open ``gguf.GGUFReader``."""
        import gguf

        reader = path_or_reader
        if isinstance(path_or_reader, (str, os.PathLike)):
            if not os.path.isfile(path_or_reader):
                raise TokenizerError(f"GGUF file {str(path_or_reader)!r} does not exist")
            reader = gguf.GGUFReader(path_or_reader)
        meta = _gguf_fields(reader)
        kind = meta.get("tokenizer.ggml.model")
        gemma = kind == "llama" and str(meta.get("general.architecture", "")).startswith("gemma")
        if kind != "gpt2" and not gemma:
            raise TokenizerError(
                f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE, "
                f"and Gemma's 'llama' SentencePiece vocabulary)")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if gemma:
            return cls._from_gguf_gemma(meta, tokens, types, path_or_reader)
        merges: list[str] = meta.get("tokenizer.ggml.merges") or []
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[(a, b) for a, _, b in (m.partition(" ") for m in merges)], dropout=None,
                         continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
        tok = _HFTokenizer(bpe)
        split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        # Control tokens spelled outside the byte alphabet are llama.cpp mislabels (transformers skips them).
        control = [AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
        tok.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
        tok.add_tokens(user)

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = {eos} if eos is not None else set()
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None:
            eos_ids.add(eot)
        name = meta.get("general.name") or (
            os.path.splitext(os.path.basename(str(path_or_reader)))[0]
            if isinstance(path_or_reader, (str, os.PathLike)) else "gguf")
        return cls(tok, name=name, bos_token_id=bos, eos_token_ids=eos_ids,
                   chat_template=meta.get("tokenizer.chat_template"),
                   special_tokens={"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                                   "unk_token": token("unknown_token_id"),
                                   "pad_token": token("padding_token_id")},
                   add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def _from_gguf_gemma(cls, meta: dict[str, Any], tokens: list[str], types: list[int],
                         source: Any) -> "Tokenizer":
        """Gemma's vocabulary as transformers builds it from a GGUF (merges from vocabulary order)."""
        respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(respelled)}
        merges = _merges_from_vocab(vocab, {t: -i for i, t in enumerate(respelled)})
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, dropout=None, byte_fallback=True,
                         unk_token=tokens[unk] if unk is not None else "<unk>")
        tok = _HFTokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
        tok.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = {eos} if eos is not None else set()
        for key in ("tokenizer.ggml.eot_token_id",):
            if meta.get(key) is not None:
                eos_ids.add(meta[key])
        if (eot := vocab.get("<end_of_turn>")) is not None:
            eos_ids.add(eot)
        name = meta.get("general.name") or (
            os.path.splitext(os.path.basename(str(source)))[0] if isinstance(source, (str, os.PathLike)) else "gguf")
        return cls(tok, name=name, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_ids=eos_ids,
                   chat_template=meta.get("tokenizer.chat_template") or GEMMA_TEMPLATE,
                   special_tokens={"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                                   "unk_token": token("unknown_token_id"),
                                   "pad_token": token("padding_token_id")},
                   add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_dir(cls, path: str) -> "Tokenizer":
        """Build from a Hugging Face model directory (needs ``tokenizer.json``)."""
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise TokenizerError(f"model directory {path!r} has no tokenizer.json")
        try:
            tok = _HFTokenizer.from_file(tj)
        except Exception as e:  # noqa: BLE001
            raise TokenizerError(f"cannot read {tj!r}: {e}") from None
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        model_cfg = _read_json(os.path.join(path, "config.json"))

        special = {k: _token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        bos_id = tok.token_to_id(special["bos_token"]) if special["bos_token"] else None
        if bos_id is None and isinstance(model_cfg.get("bos_token_id"), int):
            bos_id = model_cfg["bos_token_id"]
        eos_ids: set[int] = set()
        eos_id = tok.token_to_id(special["eos_token"]) if special["eos_token"] else None
        if eos_id is not None:
            eos_ids.add(eos_id)
        eos_ids |= _int_ids(gen.get("eos_token_id"))
        if not eos_ids:
            eos_ids = _int_ids(model_cfg.get("eos_token_id"))
        return cls(tok, name=os.path.basename(os.path.normpath(path)), bos_token_id=bos_id,
                   eos_token_ids=eos_ids, chat_template=_hf_chat_template(path, cfg),
                   special_tokens=special, add_bos_token=bool(cfg.get("add_bos_token", False)))

    @property
    def name(self) -> str:
        return self._name

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self._eos)

    @property
    def vocab_size(self) -> int:
        """Ids ``0 .. vocab_size-1`` (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> _HFTokenizer:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens``: the BOS the model wants and the post-processor's."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self._bos is not None \
                and (not ids or ids[0] != self._bos):
            ids = [self._bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (special tokens: their text; b"" outside the vocabulary)."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if type(self._tok.decoder).__name__ == "ByteLevel":
            inverse = _unicode_to_bytes()
            if all(ch in inverse for ch in piece):
                return bytes(inverse[ch] for ch in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self._tok.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render ``messages`` with the model's chat template (extra ``kwargs`` reach the template)."""
        if not self.chat_template:
            raise TokenizerError(f"model {self._name!r} has no chat template; send a plain prompt")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TokenizerError("messages must be a list of {'role': ..., 'content': ...} objects")
        import jinja2

        template = _compile_template(self.chat_template)
        context: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **context)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from None


def _gguf_fields(reader: Any) -> dict[str, Any]:
    """The tokenizer.* and general.name metadata of a GGUFReader as Python values."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not (key.startswith("tokenizer.") or key in ("general.name", "general.architecture")):
            continue
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            out[key] = [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        else:
            out[key] = field.contents()
    return out


def _merges_from_vocab(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a vocabulary implies (transformers' ``generate_merges``), best first."""
    merges = []
    for merge, score in scores.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {path!r}: {e}") from None
    return data if isinstance(data, dict) else {}


def _int_ids(value: Any) -> set[int]:
    """An ``eos_token_id`` entry (an int, a list of ints or None) as a set."""
    if isinstance(value, int):
        return {value}
    return {x for x in value if isinstance(x, int)} if isinstance(value, list) else set()


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(path: str, cfg: dict[str, Any]) -> str | None:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    tpl = cfg.get("chat_template")
    if tpl is None:
        tpl = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    return tpl if isinstance(tpl, str) else None


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile like transformers' ``_compile_jinja_template`` (sandboxed, same helpers)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> NoReturn:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from None
