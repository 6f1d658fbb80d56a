"""Hugging Face models in and out: safetensors read a slice at a time into sharded arrays and
streamed back out, a model's source (a run's checkpoint or hf:PATH), export, generation and
`train --init-from`, through an HFAdapter (adapter.py) that the CLI hands in from models/."""
