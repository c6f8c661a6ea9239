"""Tokenizer (from GGUF metadata or ``tokenizer.json``), chat template, incremental detokenising.

GGUF files of the ``gpt2`` family (byte-level BPE: SmolLM, Llama 3, Qwen, ...) are rebuilt
with the ``tokenizers`` library from ``tokenizer.ggml.tokens`` / ``merges`` / ``token_type``
and the pre-tokenizer named by ``tokenizer.ggml.pre``.  Chat messages are rendered with the
model's own jinja2 template, in a sandbox, the way transformers' ``apply_chat_template``
does.  ``IncrementalDetokenizer`` turns token ids into text one at a time and never emits
half a UTF-8 character.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

__all__ = ["Tokenizer", "IncrementalDetokenizer"]

# llama.cpp token types
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies use it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp's ``tokenizer.ggml.pre`` names."""
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        pattern = _LLAMA3_PATTERN
    elif pre == "qwen2":
        pattern = _QWEN2_PATTERN
    else:  # "gpt2", "default" and the rest: GPT-2's own regex
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        chat_template: str | None,
        add_bos_token: bool = False,
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token = tokenizer.id_to_token(bos_token_id) if bos_token_id is not None else ""
        self.eos_token = tokenizer.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._template: jinja2.Template | None = None
        if chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(chat_template)

    # -- construction --------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"only byte-level BPE (tokenizer.ggml.model = 'gpt2') GGUF tokenizers are supported, not {kind!r}")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        token_types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "gpt2")))
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, token_types) if ty == _CONTROL]
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, token_types) if ty == _USER_DEFINED]
        if special:
            tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = [int(eos)] if eos is not None else []
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None:
            eos_ids.append(int(eot))
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            tok,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        """From a Hugging Face directory: tokenizer.json, tokenizer_config.json, generation_config.json."""
        tok = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        model_cfg = _read_json(os.path.join(path, "config.json"))

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return tok.token_to_id(value) if isinstance(value, str) else None

        bos_id = token_id(cfg.get("bos_token"))
        if bos_id is None and isinstance(model_cfg.get("bos_token_id"), int):
            bos_id = model_cfg["bos_token_id"]
        eos_ids: list[int] = []
        for source in (gen.get("eos_token_id"), model_cfg.get("eos_token_id")):
            if isinstance(source, int):
                eos_ids.append(source)
            elif isinstance(source, list):
                eos_ids.extend(int(x) for x in source)
        eos_tok = token_id(cfg.get("eos_token"))
        if eos_tok is not None:
            eos_ids.insert(0, eos_tok)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and os.path.isfile(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja")) as f:
                template = f.read()
        # tokenizer.json carries its own post-processor (which adds BOS when the model wants it)
        return cls(tok, bos_token_id=bos_id, eos_token_ids=eos_ids, chat_template=template, add_bos_token=False)

    # -- use -----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The ``tokenizers`` library's JSON of this tokenizer (what grammar libraries read
        the vocabulary and its pre-tokenizer from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (for OpenAI logprobs' ``bytes``)."""
        token = self._tok.id_to_token(token_id)
        if token is None:
            return b""
        if self._byte_level and all(c in _BYTE_DECODER for c in token):
            return bytes(_BYTE_DECODER[c] for c in token)
        return token.encode("utf-8")

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters one token can stand for (computed once from the vocabulary),
        or None when a normalizer may rewrite the text before it is split.

        A token's text is at most as many characters as its bytes, so a text of ``c``
        characters needs at least ``ceil(c / max_token_chars)`` tokens: a bound that lets a
        prompt that cannot fit be refused without tokenising it.
        """
        if self._tok.normalizer is not None:
            return None
        return max(len(self.token_bytes(i)) for i in range(self.vocab_size))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if self._template is None:
            # no template: plain "role: content" lines
            lines = [f"{m.get('role')}: {m.get('content')}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        # the template writes BOS itself when the model wants one
        return self._tok.encode(text, add_special_tokens=False).ids

    def __repr__(self) -> str:
        return f"<Tokenizer vocab={self.vocab_size} bos={self.bos_token_id} eos={self.eos_token_ids}>"


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class IncrementalDetokenizer:
    """Token ids in, text out, one token at a time.

    Decodes a short window ``ids[prefix_offset:]`` against ``ids[prefix_offset:read_offset]``
    and emits the difference only once it does not end in U+FFFD, i.e. once a multi-byte
    character is complete.  ``flush()`` releases whatever is held at the end.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-4:])
        if "\ufffd" in tokenizer.decode(context, skip_special_tokens):  # starts inside a character
            context = []
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        new_text = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end becomes U+FFFD)."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        new_text = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
