"""Datasets (generated arithmetic and instructions, local files, Hugging Face and Kaggle datasets,
GSM8K), prompt templates and the grain pipeline."""
