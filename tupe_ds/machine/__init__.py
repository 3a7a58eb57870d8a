"""Whether this machine or cluster is ready: tupe-doctor and tupe-smoke, the CUDA architectures to
build for, DeepSpeed's extension build locks, the Slurm checks."""
