"""From a checkpoint to a Hugging Face folder (write: tupe-export) and back (read: an export loaded
for fine-tuning); hf/ is the remote-code model such a folder carries."""
