"""Fine-tuning exported models on GLUE-style tasks: tasks (readers), metrics, flags, progress
(what is done), monitor (curves while it trains), report, run (tupe-finetune)."""
