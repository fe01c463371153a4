"""What nd_parallel knows about Hugging Face models: their structure (hf.py, the one place), memory-efficient
loading (loading.py, the entry point; meta.py and checkpoint_files.py beneath it) and PEFT adapters (peft.py)."""
