"""A tiny random-weight LLaVA (CLIP vision + Llama text, 4.2 M parameters) built
offline from the SentencePiece tokenizer that `mistral_common` ships.

`python tools/tiny_model.py` prints the model folder, building it on first use.
The folder name carries a hash of this file and the library versions, so tests
build it once and a change to the recipe builds a fresh one."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = pathlib.Path(os.environ.get("VLLM_MMRETRY_CACHE", ROOT / ".cache"))

IMG, PATCH = 32, 8  # 4x4 = 16 patches (+1 CLS, dropped by 'default')
CHAT = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% else %}<image>{% endif %}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def _key() -> str:
    h = hashlib.sha256(pathlib.Path(__file__).read_bytes())
    for dist in ("torch", "transformers", "tokenizers", "mistral_common", "safetensors"):
        h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
    return h.hexdigest()[:12]


def tokenizer_model_file() -> pathlib.Path:
    import mistral_common

    return pathlib.Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"


def _build(out: pathlib.Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlamaTokenizer,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    # transformers 5.x: LlamaTokenizer(vocab_file=...) gives an empty vocabulary;
    # loading a folder holding tokenizer.model converts SentencePiece offline.
    spm_dir = tempfile.mkdtemp()
    shutil.copy(tokenizer_model_file(), os.path.join(spm_dir, "tokenizer.model"))
    tok = LlamaTokenizer.from_pretrained(spm_dir)
    assert len(tok) == 32000, len(tok)
    tok.add_special_tokens({"additional_special_tokens": [
        AddedToken("<image>", special=True, normalized=False)]})
    tok.pad_token = tok.unk_token
    image_token_id = tok.convert_tokens_to_ids("<image>")
    assert image_token_id == 32000, image_token_id
    tok.chat_template = CHAT

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=IMG, patch_size=PATCH,
                              projection_dim=32)
    text = LlamaConfig(vocab_size=32064, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=32, max_position_embeddings=1024, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    cfg = LlavaConfig(vision_config=vision, text_config=text,
                      image_token_index=image_token_id,
                      vision_feature_select_strategy="default", vision_feature_layer=-2,
                      projector_hidden_act="gelu")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    # transformers 5.x writes "vision_tower.embeddings..."; vLLM's CLIPVisionModel
    # expects the llava-hf layout "vision_tower.vision_model.*".
    st = out / "model.safetensors"
    sd = load_file(st)
    sd = {("vision_tower.vision_model." + k[len("vision_tower."):]
           if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
           else k): v.contiguous() for k, v in sd.items()}
    save_file(sd, st, metadata={"format": "pt"})

    improc = CLIPImageProcessor(size={"shortest_edge": IMG},
                                crop_size={"height": IMG, "width": IMG},
                                do_center_crop=True, do_resize=True)
    proc = LlavaProcessor(image_processor=improc, tokenizer=tok, patch_size=PATCH,
                          vision_feature_select_strategy="default", image_token="<image>",
                          num_additional_image_tokens=1, chat_template=CHAT)
    proc.save_pretrained(out)
    tok.save_pretrained(out)


def build_cached(out: pathlib.Path, build: Callable[[pathlib.Path], None],
                 *needed: str) -> pathlib.Path:
    """`out`, built by `build` into a temporary sibling and renamed into place
    (atomic, so concurrent test processes never see half a folder)."""
    if all((out / name).exists() for name in needed):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=".build-"))
    build(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_tiny_model() -> pathlib.Path:
    """Folder of the tiny model, built if it is not there yet."""
    return build_cached(CACHE / "models" / f"tiny-llava-{_key()}", _build,
                        "model.safetensors", "tokenizer.json")


if __name__ == "__main__":
    print(ensure_tiny_model())
    sys.exit(0)
