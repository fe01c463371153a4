"""Tiny vision-language checkpoints and synthetic images, built locally (no hub), for the multimodal tests.

``save_tiny_vlm("llava" | "gemma3" | "mllama", DIR)`` writes a randomly initialised model (CLIP + Llama / SigLIP +
Gemma 3 text / Llama 3.2 Vision's tiled encoder + cross-attention text model, TINY's text sizes), our tiny BPE
tokenizer with the family's image special tokens, and the family's processor
(image processor + tokenizer + ChatML template), each saved with save_pretrained so that AutoProcessor and
AutoModelForImageTextToText load them back as a user's checkpoint. ``save_tiny_mistral3(DIR)`` writes a Mistral 3
(Pixtral vision + Mistral text) whose tokenizer is mistral-common's tekken.json with an image section, as Mistral's
own vision checkpoints ship it (Axolotl's `tokenizer_use_mistral_common` runs). ``write_images`` saves random-pixel
PNGs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .models import TINY, make_text

# The family's image tokens, added to the tokenizer as special tokens (ids above the BPE's, below 256).
SPECIALS = {"llava": ["<image>"], "mllama": ["<|image|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
            "gemma3": ["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>",
                       "<end_of_turn>"]}
_GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
              patch_size=4)


def _tokenizer(family: str, lines: list[str], directory: Path):
    from transformers import AutoTokenizer

    from .tokenizer import train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer(lines, vocab_size=180)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[family]})
    tokenizer.save_pretrained(directory / "tok")
    extra = {"extra_special_tokens": _GEMMA3_TOKENS} if family == "gemma3" else {}
    return AutoTokenizer.from_pretrained(directory / "tok", **extra)  # Gemma 3's processor reads boi/eoi/image


def save_tiny_vlm(family: str, directory: str | Path, seed: int = 0) -> Path:
    """A tiny ``family`` checkpoint with its processor in ``directory`` (see the module docstring)."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipVisionConfig,
    )

    directory = Path(directory)
    tokenizer = _tokenizer(family, make_text(80, seed=11), directory)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS[family]}
    torch.manual_seed(seed)
    text = {**TINY, "tie_word_embeddings": False}
    if family == "llava":  # 16x16 images in 4x4 patches: 16 image tokens (CLS dropped: the "default" strategy)
        config = LlavaConfig(vision_config=CLIPVisionConfig(**VISION, projection_dim=32),
                             text_config=LlamaConfig(**text), image_token_id=ids["<image>"])
        model = LlavaForConditionalGeneration(config)
        images = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
        processor = LlavaProcessor(images, tokenizer, patch_size=4, vision_feature_select_strategy="default",
                                   num_additional_image_tokens=1, chat_template=tokenizer.chat_template)
    elif family == "gemma3":  # 16 patches pooled to 4 image tokens, between <start_of_image> and <end_of_image>
        config = Gemma3Config(text_config={**text, "sliding_window": 64}, vision_config=SiglipVisionConfig(**VISION),
                              mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"],
                              eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"])
        model = Gemma3ForConditionalGeneration(config)
        processor = Gemma3Processor(Gemma3ImageProcessor(size={"height": 16, "width": 16}), tokenizer,
                                    image_seq_length=4, chat_template=tokenizer.chat_template)
    elif family == "mllama":  # Llama 3.2 Vision: 16x16 tiles (up to 2) of 4x4 patches, cross-attention in layer 1
        from transformers import (
            MllamaConfig,
            MllamaForConditionalGeneration,
            MllamaImageProcessorPil,
            MllamaProcessor,
            MllamaTextConfig,
            MllamaVisionConfig,
        )

        vision = MllamaVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                                    attention_heads=2, image_size=16, patch_size=4, max_num_tiles=2,
                                    intermediate_layers_indices=[0], vision_output_dim=64,
                                    supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
        config = MllamaConfig(vision_config=vision, text_config=MllamaTextConfig(
            **{k: v for k, v in text.items() if k != "head_dim"}, cross_attention_layers=[1], pad_token_id=0,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
            image_token_index=ids["<|image|>"])
        model = MllamaForConditionalGeneration(config)
        processor = MllamaProcessor(MllamaImageProcessorPil(size={"height": 16, "width": 16}, max_image_tiles=2),
                                    tokenizer, chat_template=tokenizer.chat_template)
    else:
        raise ValueError(f"no tiny vision-language model for {family!r}; use llava, gemma3 or mllama")
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def save_tiny_mistral3(directory: str | Path, seed: int = 0) -> Path:
    """A tiny Mistral3ForConditionalGeneration with a tekken.json that encodes images: 4-pixel patches merged 2x2
    into one [IMG] token (``spatial_merge_size`` 2, as the real models), images scaled to at most 32 pixels a side."""
    import json

    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    from .tekken import write_tiny_tekken

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tekken = directory / "tekken.json"
    vocab = write_tiny_tekken(tekken, make_text(80, seed=11))
    data = json.loads(tekken.read_text())
    data["image"] = {"image_patch_size": VISION["patch_size"], "max_image_size": 32, "spatial_merge_size": 2}
    tekken.write_text(json.dumps(data))
    torch.manual_seed(seed)
    vision = PixtralVisionConfig(**{**VISION, "image_size": 32})
    config = Mistral3Config(vision_config=vision, text_config=MistralConfig(**{**TINY, "vocab_size": vocab,
                                                                                 "tie_word_embeddings": False}),
                            image_token_index=10, spatial_merge_size=2, tie_word_embeddings=False)  # [IMG] is 10
    Mistral3ForConditionalGeneration(config).save_pretrained(directory)
    return directory


def write_images(directory: str | Path, n: int, seed: int = 0) -> list[Path]:
    """``n`` PNGs of random pixels and random sizes (12..24 px a side), the same for the same seed."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        h, w = rng.randint(12, 25, size=2)
        path = directory / f"image{i}.png"
        Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths
