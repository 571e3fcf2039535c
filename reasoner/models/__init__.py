"""Model loading: the embedded GGUF Gemma 3 270M, Kaggle checkpoints, random init."""
