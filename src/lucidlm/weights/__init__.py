"""Reading and writing weights: our own checkpoints, Hugging Face directories, GGUF files."""
