"""Hugging Face models in and out: safetensors read a slice at a time into sharded arrays and
streamed back out, a model's source (a run's checkpoint or hf:PATH), export, generation and
`train --init-from`, over a ModelFamily (family.py) that the CLI hands in from models/."""
