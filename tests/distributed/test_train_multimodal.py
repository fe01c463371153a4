"""`nd-parallel train` with processor_type: tiny vision-language models (Llava: CLIP + Llama; Gemma 3: SigLIP +
Gemma 3 text, a different processor, image tokens and label masking) under FSDP2, DDP and TP2 vs one process.

The rows are image chat conversations in Axolotl's three forms (an image item with a path, one with base64 bytes,
a bare image item filled from an ``images`` column), random-pixel PNGs of several sizes (fixed seed), read in
order (curriculum_sampling). The LoRA and frozen variants' rows include text-only ones, placed so that one rank's
micro-batch holds no image while the other's does (the frozen vision tower then runs on one rank only); full
fine-tuning of the tower over data-parallel ranks refuses such rows in the parent (mm_rows.check_imageless: FSDP2
cannot reduce a gradient that one rank lacks), so its rows all hold an image. Each rank processes its own rows at
collate time (data/mm_collate.py). Variants: Llava + LoRA on Axolotl's example regex
(``model.language_model.layers...``), Llava full fine-tuning (the vision tower and projector train too; under TP
they are replicated) and with freeze_mm_modules (they stay exactly as loaded), Gemma 3 full fine-tuning with its
role masking, Gemma 3 + LoRA with freeze_mm_modules, and Gemma 3's image-text class trained on text rows without a
processor (model_type: Gemma3ForConditionalGeneration, as Axolotl's Llama 4 text YAMLs run their class), and Mistral
3 (Pixtral + Mistral) + LoRA through mistral-common (tokenizer_use_mistral_common: its tekken.json encodes the images,
data/mm_mistral.py), and Llama 3.2 Vision (Mllama: tiled images, cross-attention layers) + LoRA with the
llama3_2_vision template (drop_system_message, as that template takes no system message beside images; every row
with an image, as its cross-attention layers run only with images). DDP runs for two variants only (its data path is
FSDP2's).
Gradient accumulation 2, linear LR, seed 0, 3 steps, no epoch end. All parallel runs share ONE 2-rank launch,
the references one process; for dp 2 the reference's micro_batch_size is doubled (the same global batches).

Tolerances: the loss of every step within rtol 1e-5 and every saved tensor within atol 1e-5, as the text YAML
parity (test_train_yaml_parity.py): fp32 throughout, the only differences being the order of the fp32 sums
(sharded / split reductions, and padding to each rank's longest row instead of the global batch's longest, which
changes matmul shapes but no real token's value). A wrong label mask, a lost image, a rank reading another rank's
rows or a vision tower that does not train moves the loss or the tensors by orders of magnitude more (checked: the
full-fine-tuning runs' patch embedding and projector move by > 1e-4, and LoRA's B leaves zero). Measured: losses
within 2e-7 relative, saved tensors within 1e-6 (2026-12-03, 15 runs, about 3.5 min on 2 CPU cores; 2026-12-04,
17 runs with Mistral 3 through mistral-common: FSDP2 loss 8.3e-8 / tensors 5.9e-8, TP2 0 / 4.9e-7, and Mllama
FSDP2: loss 0 / tensors 1.1e-7; 55 s on a quiet machine).
"""

import base64
import json

import pytest

from nd_parallel.testing.models import make_text
from nd_parallel.testing.multimodal import save_tiny_mistral3, save_tiny_vlm, write_images
from tests.distributed.train_yaml_helpers import compare_runs, jobs_for, logged, run_jobs, write_yaml

BASE = dict(processor_type="AutoProcessor", skip_prepare_dataset=True, remove_unused_columns=False,
            sample_packing=False, sequence_len=256, micro_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
            learning_rate=1e-3, lr_scheduler="linear", weight_decay=0.01, seed=0, adam_epsilon=1e-6,
            optimizer="adamw_torch", bf16="auto", curriculum_sampling=True)
REGEX = r"model.language_model.layers.[\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)_proj"  # Axolotl
LORA = dict(adapter="lora", lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=REGEX)
# Without processor_type, an image-text model_type trains on text rows (Axolotl's Llama 4 text YAMLs do that).
TEXT_ONLY = dict(model_type="Gemma3ForConditionalGeneration", chat_template="gemma3", curriculum_sampling=True,
                 sequence_len=256, micro_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3,
                 lr_scheduler="linear", weight_decay=0.01, seed=0, adam_epsilon=1e-6, optimizer="adamw_torch",
                 bf16="auto", **LORA)
VARIANTS = {"llava_lora": ("llava", dict(chat_template="llava", **LORA)),
            "llava_full": ("llava", dict(chat_template="llava")),
            "llava_full_frozen": ("llava", dict(chat_template="llava", freeze_mm_modules=True)),
            "gemma3_full": ("gemma3", dict(chat_template="gemma3")),
            "gemma3_lora_frozen": ("gemma3", dict(chat_template="gemma3", freeze_mm_modules=True, **LORA)),
            "gemma3_text_lora": ("gemma3", TEXT_ONLY),
            "mistral3_mc_lora": ("mistral3", dict(tokenizer_use_mistral_common=True, **LORA)),
            "mllama_lora": ("mllama", dict(chat_template="llama3_2_vision", **LORA))}
LAYOUTS = {"fsdp2": ({"dp_shard_size": 2}, 2), "ddp": ({"dp_replicate_size": 2}, 2),
           "tp2": ({"tensor_parallel_size": 2}, 1)}
# DDP shares FSDP2's data path (each rank its own rows): two variants run it, one with images, one with image-less
# micro-batches on one rank
DDP = ("llava_lora", "gemma3_full")
NO_TP = ("mllama_lora",)  # transformers gives Mllama no tp_plan: tensor_parallel_size > 1 is refused for it
CASES = [(v, lay) for v in VARIANTS for lay in LAYOUTS
         if (lay != "ddp" or v in DDP) and (lay != "tp2" or v not in NO_TP)]


def _rows(root, n: int = 48, text_only: bool = False) -> list[dict]:
    """n conversations with one image in Axolotl's three forms (path, base64, images column); with text_only, 1 in
    6 has none."""
    images, lines = write_images(root / "images", 8, seed=0), make_text(3 * n, seed=5)
    rows = []
    for i in range(n):
        image, user, answer = images[i % len(images)], lines[3 * i], lines[3 * i + 1]
        if text_only and i % 12 in (2, 3):  # read in order, these two make one rank's micro-batch without an image
            turns, extra = [{"role": "user", "content": user}], {}
        elif i % 3 == 0:
            item = {"type": "image", "path": str(image)}
            turns = [{"role": "user", "content": [item, {"type": "text", "text": user}]}]
            extra = {}
        elif i % 3 == 1:
            item = {"type": "image", "base64": base64.b64encode(image.read_bytes()).decode()}
            turns = [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": user}, item]}]
            extra = {}
        else:
            turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": user}]}]
            extra = {"images": [str(image)]}
        turns += [{"role": "assistant", "content": answer}, {"role": "user", "content": lines[3 * i + 2]},
                  {"role": "assistant", "content": [{"type": "text", "text": answer[::-1]}]}]
        rows.append({"messages": turns, **extra})
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_multimodal")
    models = {family: str(save_tiny_vlm(family, root / family, seed=1)) for family in ("llava", "gemma3", "mllama")}
    models["mistral3"] = str(save_tiny_mistral3(root / "mistral3", seed=1))
    (root / "mm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(root)))
    (root / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(root, text_only=True)))
    parallel, refs = [], []
    (root / "text.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": a},
                                                                       {"role": "assistant", "content": b}]}) + "\n"
                                            for a, b in zip(make_text(48, seed=6), make_text(48, seed=7))))
    for variant, (family, keys) in VARIANTS.items():
        # mllama: every row holds an image (its cross-attention layers run only with images: mm_rows.check_imageless)
        data = "text.jsonl" if keys is TEXT_ONLY else "mm.jsonl" if variant.endswith("_full") or family == "mllama" \
            else "mixed.jsonl"
        entry = {"path": str(root / data), "type": "chat_template"}
        if family == "mllama":  # Llama 3.2 Vision's template takes no system message beside images
            entry["drop_system_message"] = True
        shared = {**({} if keys is TEXT_ONLY else BASE), **keys, "base_model": models[family], "datasets": [entry]}
        for layout, (sizes, _) in LAYOUTS.items():
            if (variant, layout) not in CASES:
                continue
            parallel.append(write_yaml(root / f"{variant}-{layout}.yaml",
                                       {**shared, **sizes, "output_dir": str(root / f"{variant}-{layout}")}))
        for dp in (1, 2):
            refs.append(write_yaml(root / f"{variant}-ref{dp}.yaml", {
                **shared, "output_dir": str(root / f"{variant}-ref{dp}"), "micro_batch_size": 2 * dp}))
    run_jobs(jobs_for(refs, root, 1), root, 1)
    run_jobs(jobs_for(parallel, root, 2), root, 2, timeout=900)
    return root, models


@pytest.mark.parametrize("variant,layout", CASES, ids=[f"{v}-{lay}" for v, lay in CASES])
def test_multimodal_yaml_matches_one_process(runs, variant, layout):
    root, models = runs
    got, ref = root / f"{variant}-{layout}", root / f"{variant}-ref{LAYOUTS[layout][1]}"
    assert [r["step"] for r in logged(got)] == [1, 2, 3]
    _, tensors = compare_runs(got, ref, rtol=1e-5, atol=1e-5, label=f"{variant} {layout}")
    if VARIANTS[variant][0] == "mistral3":  # mistral-common's tokenizer is the processor, saved with the adapter
        assert (got / "tekken.json").is_file()
    elif VARIANTS[variant][1] is not TEXT_ONLY:
        assert (got / "processor_config.json").is_file() or (got / "preprocessor_config.json").is_file()
    if "lora" in variant:
        assert max(v.abs().max().item() for k, v in tensors.items() if "lora_B" in k) > 0  # the adapter trained
        assert all(".language_model.layers." in k for k in tensors), sorted(tensors)[:4]  # Axolotl's regex only
    else:
        from transformers import AutoModelForImageTextToText

        # the tiny checkpoint is saved by transformers under its older key names: compare the names it loads under
        before = AutoModelForImageTextToText.from_pretrained(models[VARIANTS[variant][0]]).state_dict()
        moved = {k: (tensors[k] - before[k]).abs().max().item() for k in before if k in tensors}
        vision = {k: v for k, v in moved.items() if ".vision_tower." in k or ".multi_modal_projector." in k}
        assert vision and min(v for k, v in moved.items() if k not in vision) > 0  # the language model trained
        if variant.endswith("_frozen"):  # freeze_mm_modules: the tower and projector are exactly as loaded
            assert max(vision.values()) == 0, {k: v for k, v in vision.items() if v}
        else:  # the patch embedding (the tower's first weight) and the projector moved (not all of the tower
            # does: Llava reads its second-to-last layer, so the last one and the post-norm get no gradient)
            first = {k: v for k, v in vision.items() if "patch_embedding.weight" in k or "multi_modal_projector" in k}
            assert len(first) >= 2 and min(first.values()) > 1e-4, first
