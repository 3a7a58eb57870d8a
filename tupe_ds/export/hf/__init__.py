"""The Hugging Face form of an export (`tupe-export --format hf`).

configuration_tupe.py and modeling_tupe.py are copied into every such folder and loaded from
there by transformers (`trust_remote_code=True`): they import only torch and transformers.
convert.py (which transformers never sees) maps tupe_ds's parameter names to theirs and writes
the folder.
"""
