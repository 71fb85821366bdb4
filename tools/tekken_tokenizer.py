"""A second real vocabulary, built offline: Mistral's Tekken (tiktoken-style byte-level
BPE, 131072 tokens) from the `tekken_240911.json` that `mistral_common` ships, converted
to a Hugging Face fast tokenizer folder by transformers' own converter.

`python tools/tekken_tokenizer.py` prints the folder, building it on first use (~3 s).
The folder name carries a hash of this file, the source vocabulary and the library
versions, so a change to any of them builds a fresh one."""

from __future__ import annotations

import hashlib
import importlib.metadata
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from tiny_model import CACHE, build_cached

VOCAB_SIZE = 131072


def tekken_file() -> pathlib.Path:
    import mistral_common

    return pathlib.Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"


def _key() -> str:
    h = hashlib.sha256(pathlib.Path(__file__).read_bytes())
    h.update(tekken_file().read_bytes())
    for dist in ("transformers", "tokenizers", "mistral_common"):
        h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
    return h.hexdigest()[:12]


def _build(out: pathlib.Path) -> None:
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    # chat_template="" keeps the converter from generating one (not needed here).
    tok = convert_tekken_tokenizer(str(tekken_file()), chat_template="")
    assert len(tok) == VOCAB_SIZE, len(tok)
    tok.save_pretrained(out)


def ensure_tekken_tokenizer() -> pathlib.Path:
    """Folder of the converted Tekken tokenizer, built if it is not there yet."""
    return build_cached(CACHE / "tokenizers" / f"tekken-240911-{_key()}", _build,
                        "tokenizer.json")


if __name__ == "__main__":
    print(ensure_tekken_tokenizer())
    sys.exit(0)
