"""Datasets: plain text, JSONL, chat and instruction formats, packing (dataset); reading .jsonl / .json /
.parquet files and Hugging Face hub datasets (files)."""
