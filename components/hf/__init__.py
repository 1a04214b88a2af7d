"""Hugging Face interchange: loading HF weights into an ingot model (load.py) and exporting a checkpoint as an HF
folder (export.py). Each family says how its names map (models/<family>/hf_mapping.py)."""
