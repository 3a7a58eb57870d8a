"""Fine-tuning exported models on GLUE-style tasks: tasks (readers), metrics, run (tupe-finetune)."""
