"""The distributed runtime: megatron-core's process groups and the glue to DeepSpeed's engine
(parallel), and what the launchers (deepspeed, torchrun, srun, mpirun) give a process (launch)."""
