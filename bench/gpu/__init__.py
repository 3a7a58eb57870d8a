"""The GPU benchmarks: step_time (our DeepSpeed step against Hugging Face's BERT, the
ELECTRA pair, the ZeRO sweep) and suite (every GPU measurement in one go), with their
measurements (measure, counts, runners) and reports (report, markdown). Run from the
repository's root: `python -m bench.gpu.suite`, `deepspeed --num_gpus 1 --module
bench.gpu.step_time`."""
