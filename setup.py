from setuptools import find_packages, setup

setup(
    name="nd_parallel",
    version="0.1.0",
    description="HSDP, tensor, context and pipeline parallelism for any Hugging Face causal LM, from Accelerate",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The top-level plugins/ folder is installed as nd_parallel.plugins: nothing named `plugins` lands top-level.
    packages=find_packages(include=["nd_parallel", "nd_parallel.*"])
    + ["nd_parallel." + p for p in find_packages(include=["plugins", "plugins.*"])],
    package_dir={"nd_parallel.plugins": "plugins"},
    install_requires=[
        "torch>=2.9,<2.15",  # tested with 2.13
        "transformers>=5.16,<5.25",  # 5.16.1: Axolotl 0.19's pin
        "accelerate>=1.13,<1.16",  # 1.13.0: Axolotl 0.19's pin
        "safetensors>=0.4",
        "pyyaml>=6.0",
        "tqdm>=4.60",
        "peft>=0.20,<0.22",  # LoRA under every layout; 0.20 is Axolotl 0.19's pin
        "datasets>=3.0",  # nd-parallel train's data pipeline (Axolotl 0.19 runs 4.8)
        "tokenizers>=0.21",  # local tokenizers (make-tiny, the byte-level fallback)
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3", "deepspeed>=0.19.8,<0.20", "matplotlib>=3.7", "trl>=1.9,<2",
                 "bitsandbytes>=0.50.2,<0.51", "mistral-common[opencv]>=1.11.5,<2", "torchao>=0.17,<0.19",
                 "scipy>=1.11", "sacrebleu>=2.4,<3"],
        "bench": ["matplotlib>=3.7"],
        # do_causal_lm_eval's sacrebleu / chrf / ter (cli/train/lm_eval.py); perplexity needs nothing more
        "eval": ["sacrebleu>=2.4,<3"],
        "deepspeed": ["deepspeed>=0.19.8,<0.20"],
        # TRL's SFTTrainer under every layout (plugins/trainer/sft.py): 1.9 is what Axolotl 0.19 pins, 1.16 is tested
        "trl": ["trl>=1.9,<2"],
        # QLoRA (load_in_4bit) and the 8-bit optimizers; its CPU backend serves CPU ranks. Requires torch (already
        # installed), numpy and packaging: it pulls no second torch.
        "qlora": ["bitsandbytes>=0.50.2,<0.51"],
        # LoftQ initialization of LoRA (peft: {loftq_config: ...}): bitsandbytes' quantizers, and scipy, which peft
        # requires for init_lora_weights="loftq"
        "loftq": ["bitsandbytes>=0.50.2,<0.51", "scipy>=1.11"],
        # tokenizer_use_mistral_common (tekken.json through transformers' MistralCommonBackend). 1.11.5: Axolotl 0.19's
        # pin and transformers' minimum; pulls no torch (it caps numpy below 2.4 on Python <= 3.12). [opencv]: its
        # image encoder (processor_type with tokenizer_use_mistral_common) resizes with OpenCV (headless wheel).
        "mistral": ["mistral-common[opencv]>=1.11.5,<2"],
        # Quantization-aware training (qat:, models/qat.py): 0.17 is Axolotl 0.19's pin, 0.18 is tested; pure Python
        # on CPU (its CUDA extensions are optional), it pulls no second torch.
        "qat": ["torchao>=0.17,<0.19"],
    },
    entry_points={"console_scripts": ["nd-parallel=nd_parallel.cli.main:main"]},
)
