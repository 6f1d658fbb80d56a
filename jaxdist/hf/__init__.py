"""Hugging Face models in and out: safetensors read a slice at a time into sharded arrays and
streamed back out."""
